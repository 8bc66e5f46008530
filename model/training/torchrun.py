"""`python -m model.training.torchrun ARGS`: torchrun (torch.distributed.run, unchanged) in a process that dies with
its parent, whose stores listen only on the address they are named by (model/training/distributed.py:
listen_where_named; torch's own listen on every interface and unpickle what they read).

Linux's PR_SET_PDEATHSIG makes the kernel send SIGKILL to this launcher when the process that started it
(the `bert` command, or the worker process holding the job's lease) exits, however it exits; each rank
does the same for this launcher (model/training/distributed.py: init), so no rank trains on alone after a
`kill -9`. Reference: prctl(2); https://pytorch.org/docs/stable/elastic/run.html
"""

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main

from model.training.distributed import die_with_parent, listen_where_named

if __name__ == "__main__":
    die_with_parent(signal.SIGKILL)
    listen_where_named()
    try:
        main(sys.argv[1:])
    except SignalException as e:  # Ctrl-C or SIGTERM: torchrun has passed it on to the ranks, which stopped
        sys.exit(128 + int(e.sigval))
