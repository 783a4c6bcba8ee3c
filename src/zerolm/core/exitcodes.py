"""Every exit code a `zerolm` command returns, in one place (the README's table is this one).

0 done. Anything a script may act on has its own code: 2 is always the user's input, never a failure
of the run; 75 and 76 are the two that ask for a restart (a SLURM or TPU-VM relaunch loop requeues
on them and on nothing else).
"""

EXIT_OK = 0
EXIT_USAGE = 2  # bad input: a flag, config key, file, dataset or checkpoint; a directory another run holds; a
#                train step the device's memory cannot hold (train.micro_batch_size, model.remat), or a checkpoint's
#                state; a checkpoint this user may not read
EXIT_NONFINITE = 3  # a non-finite loss or gradient norm (or too many skipped updates in a row)
EXIT_DOES_NOT_FIT = 4  # `zerolm compile`: the step compiles but its peak exceeds the target's usable memory
EXIT_STORAGE = 74  # EX_IOERR: storage failed mid-run: a checkpoint could not be written (a full disk, a refused
#                   write) or read, or gs:// stopped answering; the last complete checkpoint stays the latest
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: SIGTERM or Ctrl-C; the step reached was saved; run again to resume
EXIT_PEER_LOST = 76  # a peer process of a multi-process run died: restart; it resumes from the last checkpoint
EXIT_BUG = 70  # EX_SOFTWARE: an error of zerolm's own (a bug), printed with its traceback; never the user's input
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C before the first step, or a second Ctrl-C that abandoned the save

EXIT_RESTART = (EXIT_PREEMPTED, EXIT_PEER_LOST)  # the codes a relaunch loop requeues on
