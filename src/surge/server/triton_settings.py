"""Triton's log and trace settings, and its shared-memory calls, as surge answers them
(shared by HTTP /v2/logging, /v2/trace/setting, /v2/*sharedmemory/* and the gRPC
LogSettings, TraceSetting and *SharedMemory* RPCs).

Log settings map onto surge's one log level (the `surge` and uvicorn loggers):
log_error / log_warning / log_info switch the level down to ERROR / WARNING / INFO,
log_verbose_level > 0 to DEBUG. surge does not trace requests and keeps tensors in
the request, so trace settings are readable and only settable to what they are
(trace_level OFF), and shared memory answers UNSUPPORTED, with Triton's statuses
for it (HTTP 501, gRPC UNIMPLEMENTED).
"""

from __future__ import annotations

import logging

from surge.errors import InvalidInput, Unsupported

LOGGERS = ("surge", "uvicorn", "uvicorn.error")
LOG_KEYS = {"log_file": str, "log_info": bool, "log_warning": bool, "log_error": bool, "log_verbose_level": int,
            "log_format": str}
TRACE_DEFAULTS = {"trace_file": "", "trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
                  "log_frequency": "0", "trace_mode": "triton"}
SHARED_MEMORY = ("shared-memory tensors are not supported by surge: send the tensor data in the request "
                 "(JSON, the binary tensor data extension, or gRPC raw_input_contents)")


def init_log_level(level: str) -> None:
    """Give the surge logger the server's --log-level unless something set it already."""
    logger = logging.getLogger("surge")
    if logger.level == logging.NOTSET:
        value = logging.getLevelName(level.upper())  # an int for a known level name
        logger.setLevel(value if isinstance(value, int) else logging.INFO)


def log_settings() -> dict:
    level = logging.getLogger("surge").getEffectiveLevel()
    return {"log_file": "", "log_info": level <= logging.INFO, "log_warning": level <= logging.WARNING,
            "log_error": level <= logging.ERROR, "log_verbose_level": 1 if level <= logging.DEBUG else 0,
            "log_format": "default"}


def update_log_settings(changes: dict) -> dict:
    """Apply Triton-style log settings (None: leave as is); returns the settings after."""
    now = log_settings()
    for key, value in changes.items():
        kind = LOG_KEYS.get(key)
        if kind is None:
            raise InvalidInput(f"unknown log setting '{key}' (known: {', '.join(LOG_KEYS)})", param=key)
        if value is None:
            continue
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise InvalidInput(f"log setting '{key}' must be {kind.__name__}, got {value!r}", param=key)
        if key == "log_file" and value != "":
            raise Unsupported("surge logs to its standard error only: log_file cannot be set")
        if key == "log_format" and value != "default":
            raise Unsupported(f"log_format '{value}' is not supported (only 'default')")
        now[key] = value
    if now["log_verbose_level"] < 0:
        raise InvalidInput("log_verbose_level must be >= 0", param="log_verbose_level")
    # One level: each switch implies the ones above it.
    if now["log_verbose_level"] > 0:
        level = logging.DEBUG
    elif now["log_info"]:
        level = logging.INFO
    elif now["log_warning"]:
        level = logging.WARNING
    elif now["log_error"]:
        level = logging.ERROR
    else:
        level = logging.CRITICAL
    implied = {"log_info": level <= logging.INFO, "log_warning": level <= logging.WARNING,
               "log_error": level <= logging.ERROR}
    for key, on in implied.items():
        if key in changes and changes[key] is not None and changes[key] != on:
            raise InvalidInput(f"surge has one log level: '{key}' cannot be {str(changes[key]).lower()} "
                               f"with these settings (it would be {str(on).lower()})", param=key)
    for name in LOGGERS:
        logging.getLogger(name).setLevel(level)
    return log_settings()


def trace_settings() -> dict:
    return {k: (list(v) if isinstance(v, list) else v) for k, v in TRACE_DEFAULTS.items()}


def update_trace_settings(changes: dict) -> dict:
    """Accepts a setting only at the value it has (surge does not trace); returns the settings."""
    for key, value in changes.items():
        if key not in TRACE_DEFAULTS:
            raise InvalidInput(f"unknown trace setting '{key}' (known: {', '.join(TRACE_DEFAULTS)})", param=key)
        if value is None:
            continue
        given = [str(v) for v in value] if isinstance(value, list) else [str(value)]
        current = TRACE_DEFAULTS[key] if isinstance(TRACE_DEFAULTS[key], list) else [TRACE_DEFAULTS[key]]
        if given != current:
            raise Unsupported(f"surge does not trace requests: trace setting '{key}' can only be {current} "
                              f"(got {given}); its per-stage timings are in /metrics and the model statistics")
    return trace_settings()


def shared_memory() -> None:
    raise Unsupported(SHARED_MEMORY)
