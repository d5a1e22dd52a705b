"""What every Python of the project's virtualenv runs as it starts: ``redsync_hvd.pth`` in its
site-packages (written by scripts/install.sh) imports this module.

1. TensorFlow's C++ start-up lines ("oneDNN custom operations are on", "This TensorFlow binary
   is optimized ...") are hidden unless the user set ``TF_CPP_MIN_LOG_LEVEL``: horovodrun's
   launcher imports TensorFlow to see how Horovod was built, and printed them at every launch,
   torch runs too.
2. In ``horovodrun``: :func:`redsync_hvd.launchers.hook_horovodrun` (its process waits for the job's
   ranks; Ctrl-C before the job starts ends in one line), and a host it cannot reach over ssh
   ends it in one line (:func:`redsync_hvd.hosts.hook_ssh_check`), and its check of how Horovod
   was built is answered from a cache (:func:`redsync_hvd.launch_patches.hook_build_check`).
3. In a rank of ``python -m redsync_hvd.train``: the start-up guard at once
   (:func:`redsync_hvd.launchers.guard_startup`), not only once the module runs: a Ctrl-C in the
   first second of a start on a loaded machine, before any import, also ends in one line.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_ARGV = getattr(sys, "orig_argv", None) or getattr(sys, "argv", None) or [""]
if os.path.basename(_ARGV[0] if _ARGV[0] != "-m" else "") == "horovodrun" or \
        os.path.basename((getattr(sys, "argv", None) or [""])[0]) == "horovodrun":
    from .hosts import hook_ssh_check
    from .launch_patches import hook_build_check
    from .launchers import hook_horovodrun
    hook_horovodrun()
    hook_ssh_check()
    hook_build_check()
elif "-m" in _ARGV and _ARGV[_ARGV.index("-m") + 1:][:1] in (["redsync_hvd.train"], ["redsync_hvd.tensorflow.train"]):
    from .launchers import guard_startup
    guard_startup()
