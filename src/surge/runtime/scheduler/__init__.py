"""Generation scheduling, free of any device: KV block manager, iteration scheduler, sampling params.

Unit-tested alone (tests/unit/test_scheduler.py): nothing here imports torch.
"""

from surge.runtime.scheduler.block_manager import BlockManager
from surge.runtime.scheduler.params import SamplingParams
from surge.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
from surge.runtime.scheduler.sequence import Sequence, SeqStatus
from surge.runtime.scheduler.step import ScheduledSeq

__all__ = ["BlockManager", "SamplingParams", "ScheduledSeq", "Scheduler", "SchedulerConfig", "SeqStatus", "Sequence"]
