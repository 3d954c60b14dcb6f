"""A GenerateService's LoRA adapters (vLLM's multi-LoRA serving): those its settings name, loaded at start,
and those added and removed while it serves. A mixin: the service's engine loop, message channel and
views are its own (runtime/generate_service.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from surge.errors import ConfigError, InvalidInput, NotFound

if TYPE_CHECKING:
    from surge.runtime.lora_adapters import AdapterView

log = logging.getLogger("surge.generate")


class LoraHost:
    def _start_adapters(self) -> None:
        """The configured adapters, in slots 1.. in their order (every front end of a shared engine gives
        each the same slot). On an error the engine loop is stopped (the service is never returned)."""
        try:
            self._load_configured()
        except BaseException:
            if self.remote:
                self.engine.send(("close",))
                self.engine.stop()
            else:
                self._channel.put(("close",))
            raise

    def _load_configured(self) -> None:
        wanted = self.config.lora_modules
        if len(wanted) > self.config.max_cpu_loras:
            raise ConfigError(f"model '{self.name}': {len(wanted)} LoRA modules but max_cpu_loras "
                              f"{self.config.max_cpu_loras}")
        for adapter_name, adapter_path in wanted.items():
            where = Path(adapter_path).expanduser()
            if not where.is_absolute() and (self.path / where).is_dir():  # a model.yaml's, beside the model
                where = self.path / where
            self.add_adapter(adapter_name, where)

    @property
    def runtime_adapters(self) -> bool:
        """Adapters may be added and removed while serving: allowed by the settings, and the engine is this
        service's alone (the other front ends of a shared engine would not know the new name)."""
        return self.config.allow_runtime_lora and not getattr(self.engine, "shared", False)

    def check_adapter(self, name: str, path) -> tuple:
        """Read and check a PEFT LoRA directory for this model (file work: a thread may run it) ->
        (resolved path, digest). ConfigError: unreadable, refused or too wide an adapter."""
        from surge.models.lora import read_adapter
        from surge.runtime.lora_adapters import digest_of

        shown = str(path)  # messages name the path as given: a relative one must not reveal the working directory
        path = Path(path).expanduser().resolve()
        read_adapter(path, self.engine.cfg, name, max_rank=self.config.max_lora_rank, shown=shown)
        return path, digest_of(path, shown, name)

    def add_adapter(self, name: str, path, checked: tuple | None = None) -> "AdapterView":
        """Serve a PEFT LoRA directory as model `name` -> its view (the caller registers a view added while
        serving). The engine loop keeps it in host memory and swaps it into one of its `max_loras` slots
        while its requests run. `checked`: check_adapter's result, if it ran already. ConfigError: see
        check_adapter; InvalidInput: the name is taken, max_cpu_loras adapters are loaded, or the model has
        no LoRA slots."""
        from surge.runtime.lora_adapters import Adapter, AdapterView

        if not self.config.max_loras:
            raise InvalidInput(f"model '{self.name}' was started without LoRA slots (--generation max_loras=N)",
                               param="lora_name")
        if name == self.name or name in self.adapters:
            raise InvalidInput(f"the name '{name}' is taken (a loaded adapter or the base model)", param="lora_name")
        if len(self.adapters) >= self.config.max_cpu_loras:
            raise InvalidInput(f"model '{self.name}' has {len(self.adapters)} LoRA adapters loaded, its "
                               f"max_cpu_loras; unload one or start with a larger max_cpu_loras", param="lora_name")
        path, digest = checked or self.check_adapter(name, path)
        adapter = Adapter(name, path, digest)
        # the engine loop takes messages in order: the adapter is registered before its first sequence
        self._send(("adapter", adapter.uid, str(path), name))
        self.adapters[name] = adapter
        view = AdapterView(self, adapter)
        self.views.append(view)
        log.info("model '%s': LoRA adapter '%s' (%s)", self.name, name, path)
        return view

    def remove_adapter(self, name: str):
        """Stop serving adapter `name` (NotFound if it is not loaded) -> its view, to unregister. Requests
        in flight finish with it."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise NotFound(f"LoRA adapter '{name}' of model '{self.name}' is not loaded", param="lora_name")
        if all(a.uid != adapter.uid for a in self.adapters.values()):  # the same files under another name stay
            # this pass's submissions first: the engine loop must see their sequences before it forgets
            self._admit_arrivals()
            self._send(("unadapter", adapter.uid))
        view = next(v for v in self.views if v.adapter is adapter)
        self.views.remove(view)
        return view
