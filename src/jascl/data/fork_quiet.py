"""The first module the fork server of ``prepare``'s workers imports (:func:`jascl.data.workers.worker_context`),
and imported by nothing else: it makes that server process ignore Ctrl-C (SIGINT).

A terminal's Ctrl-C reaches every process of the foreground group, the fork server included. While the server
imports torch and MONAI (its first seconds) it would stop there and print its own traceback beside the main
process's one-line message; afterwards Python's fork server ignores SIGINT anyway. The workers it forks keep
ignoring it, as ``prepare`` wants (the main process ends them).
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
