"""When bytes move: the Scheduler protocol, the asyncio scheduler, priorities and transfer handles.

Importing this package does not import the tiermem core.
"""

from tiermem.schedulers.asyncio_scheduler import AsyncioScheduler
from tiermem.schedulers.base import LinkStatistics, Priority, Scheduler, SchedulerStatistics, Transfer

__all__ = ["AsyncioScheduler", "LinkStatistics", "Priority", "Scheduler", "SchedulerStatistics", "Transfer"]
