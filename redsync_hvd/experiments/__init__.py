"""The experiment tools' shared parts: what the scripts in ``scripts/`` and the sweep command
(``python -m redsync_hvd.experiments.sweep``) have in common.

* ``jobs``      a job's environment, the ``horovodrun``/``torchrun`` command, a launch with a
                hard timeout in a session of its own, the processes of such a session
* ``machine``   what a measurement ran on (CPU, cores, GPU, versions, load)
* ``stats``     means and medians, device sync, timed calls, CUDA graph replay
* ``tables``    markdown, CSV and JSON writers
* ``sweep``     configs x ``--set`` x seeds x launchers, resumable, into one table
                (sweep definitions: ``configs/sweeps/*.yaml``; ``sweep_report`` its tables and plots)
* ``ddp_worker`` a YAML config under DDP with DDP's own or torch's PowerSGD reduction
* ``netbench``  the emulated network of ``scripts/bench_end_to_end.py``

It sits above every other layer (``.importlinter``): it may import the runner, the adapters and
the config, and nothing in the package imports it.
"""
