"""`python -m worker.ddp_job JOB_ID`, run by torchrun: one rank of a job with params.devices > 1.

worker/training.py (train_ranks) starts torchrun with N of these, in the job's lease holder's stead;
the settings come from the environment it passes on. Rank 0 runs the job exactly as a single-process
worker does (worker/training.py: train: JobReporter into job.json, publish, cancel, hand-back); the
other ranks only train (model/training/runs.py under DDP, model/training/trainer.py), with a SIGTERM stop request as
their one callback. A SIGTERM (the worker's warm shutdown, sent to the whole process group) asks every
rank to stop after the current step; rank 0 then checkpoints and records the hand-back.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from datadir import JobRecords, runner
from model.training.callbacks import Callback
from model.training.distributed import destroy, die_with_parent, env_dist
from worker import recipes
from worker.settings import WorkerSettings
from worker.telemetry import tracing
from worker.training import train

log = logging.getLogger("bertserve.worker")


class SignalFlag(Callback):
    """Set by SIGTERM/SIGINT; as a callback, stops the loop after the step (rank 0: the hand-back)."""

    def __init__(self):
        self.event = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.event.set())

    def is_set(self) -> bool:
        return self.event.is_set()

    def should_stop(self) -> bool:
        return self.is_set()


def main(argv: list[str]) -> int:
    die_with_parent()  # before anything: no rank outlives the launcher (worker/training.py)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(rank)s %(message)s")
    job_id, settings, flag = argv[0], WorkerSettings(), SignalFlag()
    tracing.configure("bertserve-worker")  # rank 0's spans join its launcher's (TRACEPARENT, worker/training.py)
    records, d = JobRecords(settings.data_dir), env_dist()

    def tag_rank(record: logging.LogRecord) -> bool:
        record.rank = d.rank
        return True

    logging.getLogger().handlers[0].addFilter(tag_rank)
    record = records.read(job_id)
    if d.is_main:  # the attempt the launching worker began, and holds the lease of
        outcome = train(runner.Attempt.joined(records, record), settings, shutting_down=flag)
        log.info("job %s: %s", job_id, outcome)
    else:
        recipes.run(record, settings.data_dir, records.job_dir(job_id), settings.worker_device, [flag])
    destroy()  # leave the process group before exiting (app/cli/train_commands.py says why)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
