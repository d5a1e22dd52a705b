"""docs/architecture.md is the code: the path it names from each hook to the collective is the path
a gradient takes, and every ``file.py:function`` it names exists.

The path is traced with ``sys.setprofile`` in a steady-state step of RedSync with exactly k per
layer (``selection.method: radix``, the GPU path, here on the CPU), from the gradient hook that
completes the planned bucket to the start of its allgather. A file counts where a file of the
path calls into it; what a kernel or a communicator does inside (``core/``, ``comm/``) is that
leaf's own business. A file is entered twice where a call goes back into a file that is still
on the call stack beneath its caller (A calls B calls A).
"""
import ast
import re
import sys
from pathlib import Path

import torch

from redsync_hvd.comm import LocalCommunicator

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "redsync_hvd"
DOC = REPO / "docs/architecture.md"
LEAVES = ("core/", "comm/")
SPEC = {"method": "redsync", "local_steps": 1, "density": 0.01, "selection": "radix",   # the per-step path
        "dgc": {"momentum_correction": True}, "policy": {"min_compress_numel": 1000}}


class PathTrace:
    """Project files entered from the path, in order, until a collective named ``until`` starts."""

    def __init__(self, until: str = "allgather_async"):
        self.until, self.files, self.reentered, self.done = until, [], [], False

    @staticmethod
    def _project(frame):
        name = frame.f_code.co_filename
        return str(Path(name).resolve().relative_to(PKG)) if name.startswith(str(PKG)) else None

    def _callers(self, frame) -> list:
        out, f = [], frame.f_back
        while f is not None:
            rel = self._project(f)
            if rel is not None and (not out or out[-1] != rel):
                out.append(rel)
            f = f.f_back
        return out

    def __call__(self, frame, event, arg):
        if event != "call" or self.done:
            return
        callee = self._project(frame)
        if callee is None:
            return
        callers = self._callers(frame)
        caller = callers[0] if callers else None
        if caller is None or caller.startswith(LEAVES) or caller == callee:
            return
        if callee in callers[1:]:
            self.reentered.append(f"{caller} -> {callee}")
        if callee not in self.files:
            self.files.append(callee)
        if callee.startswith("comm/") and frame.f_code.co_name == self.until:
            self.done = True

    def __enter__(self):
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def traced_submit(ex, trace: PathTrace):
    """``ex.submit``, traced for the gradient that completes the planned bucket."""
    (planned,) = ex.planned
    submit = ex.submit

    def traced(name, grad):
        if name in planned.names and len(planned._grads) == len(planned.names) - 1:
            return trace_call(trace, submit, name, grad)
        return submit(name, grad)
    return traced


def horovod_path() -> PathTrace:
    """The path in DistributedOptimizer's gradient hooks, in the fourth step."""
    import redsync_hvd.torch as rhvd
    model = net()
    opt = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(), compression=SPEC,
                                    communicator=LocalCommunicator(2))
    ex, x, trace = opt.exchange, torch.randn(8, 64), PathTrace()
    for step in range(4):
        if step == 3:
            ex.submit = traced_submit(ex, trace)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return trace


def ddp_path(tmp_path) -> PathTrace:
    """The path in the DDP communication hook (gloo, one process), in the fourth step."""
    import torch.distributed as dist

    import redsync_hvd.torch.ddp as rddp
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(net())
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = rddp.register(model, compression=SPEC, optimizer=sgd)
        x, trace = torch.randn(8, 64), PathTrace()
        for step in range(4):
            if step == 3:
                state.exchange.submit = traced_submit(state.exchange, trace)
            sgd.zero_grad()
            model(x).square().mean().backward()
            sgd.step()
    finally:
        dist.destroy_process_group()
    return trace


def trace_call(trace, fn, *args):
    with trace:
        return fn(*args)


def documented_path(name: str) -> list:
    """The files docs/architecture.md lists between ``<!-- path: name -->`` and ``<!-- /path -->``."""
    text = DOC.read_text()
    block = text.split(f"<!-- path: {name} -->", 1)[1].split("<!-- /path -->", 1)[0]
    return re.findall(r"^\d+\. \*\*`([\w/]+\.py)`\*\*", block, re.MULTILINE)


def test_the_optimizers_hook_reaches_the_collective_through_the_documented_files():
    trace = horovod_path()
    assert trace.done, trace.files
    path = ["torch/optimizer.py"] + trace.files
    assert len(path) <= 6 and not trace.reentered, (path, trace.reentered)
    # the last file is the communicator: here the one-process stand-in for comm/horovod.py
    assert path[:-1] + ["comm/horovod.py"] == documented_path("horovod") and path[-1] == "comm/local.py", path


def test_the_ddp_hook_reaches_the_collective_through_the_documented_files(tmp_path):
    trace = ddp_path(tmp_path)
    assert trace.done, trace.files
    path = ["torch/ddp.py"] + trace.files
    assert len(path) <= 6 and not trace.reentered, (path, trace.reentered)
    assert path == documented_path("ddp"), path


def test_every_function_the_document_names_exists():
    """`file.py:Name.attr` references in docs/architecture.md name real functions and classes."""
    refs = re.findall(r"`([\w/]+\.py):([\w.]+)`", DOC.read_text())
    assert len(refs) >= 20, refs
    missing = []
    for file, qualname in refs:
        path = PKG / file
        if not path.exists():
            missing.append(f"{file} (no such file)")
            continue
        scope = ast.parse(path.read_text())
        for part in qualname.split("."):
            scope = next((n for n in getattr(scope, "body", []) if getattr(n, "name", None) == part
                          or (isinstance(n, (ast.Assign, ast.AnnAssign)) and part in ast.unparse(n).split("=")[0])),
                         None)
            if scope is None:
                missing.append(f"{file}:{qualname}")
                break
    assert not missing, missing


# -- the exchange's buckets speak in types, not sentinels ------------------------------------------
EXCHANGE = PKG / "exchange"
BUCKET_FILES = ("buckets.py", "gather.py", "planned.py", "scatter.py")


def _calls(tree, name: str) -> list:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == name]


def test_every_bucket_is_a_bucket_with_its_own_kind():
    """Each bucket kind subclasses exchange/buckets.py:Bucket and says its kind; the planned bucket's
    memory is given when it is built (nothing assigns a bucket's memory afterwards)."""
    from redsync_hvd.exchange.buckets import Bucket, ReduceBucket
    from redsync_hvd.exchange.gather import GatherBucket
    from redsync_hvd.exchange.planned import PlannedBucket
    from redsync_hvd.exchange.scatter import ScatterBucket
    kinds = {cls: cls.kind for cls in (ReduceBucket, GatherBucket, ScatterBucket, PlannedBucket)}
    assert all(issubclass(cls, Bucket) for cls in kinds), kinds
    assert sorted(kinds.values()) == ["gather", "planned", "reduce", "scatter"], kinds
    late = [f"{p.name}:{n.lineno}" for p in EXCHANGE.glob("*.py") for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "memory"
                                                 and ast.unparse(t.value) != "self" for t in n.targets)]
    assert not late, late


def test_no_isinstance_on_a_bucket_result_and_no_sentinel_strings():
    """exchange/: no ``isinstance`` (a result is one type: a bucket's finish returns an Arrived,
    a message's non-finite flag is a tensor or None), and no handle or size mode held as a string."""
    hits = []
    for path in sorted(EXCHANGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        hits += [f"{path.name}:{n.lineno} isinstance" for n in _calls(tree, "isinstance")]
        hits += [f"{path.name}:{n.lineno} {ast.unparse(n)}" for n in ast.walk(tree) if isinstance(n, ast.Compare)
                 and any(isinstance(c, ast.Constant) and c.value in ("rows", "fixed", "header") for c in n.comparators)]
        hits += [f"{path.name}:{n.lineno} is True" for n in ast.walk(tree) if isinstance(n, ast.Compare)
                 and any(isinstance(c, ast.Constant) and c.value is True for c in n.comparators)]
    assert not hits, hits


def test_the_scatter_group_and_every_bucket_return_one_arrived():
    """``finish`` of every bucket kind and of the scatter group is annotated to return an Arrived."""
    wrong = []
    for path in sorted(EXCHANGE.glob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.FunctionDef) and n.name == "finish" and path.name in BUCKET_FILES \
                    and (n.returns is None or ast.unparse(n.returns) != "Arrived"):
                wrong.append(f"{path.name}:{n.lineno} -> {ast.unparse(n.returns) if n.returns else None}")
    assert not wrong, wrong


def _tensors(obj, seen=None, depth=0) -> list:
    """The tensors an object keeps in its attributes (dicts, lists, tuples and dataclasses followed two deep)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 3:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("redsync_hvd"):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in _tensors(item, seen, depth + 1)]


def test_one_class_in_memory_holds_what_is_carried():
    """memory/state.py:Carried is the one class that keeps residual state: every memory's residuals,
    DGC's velocities and a worker's Adam moments, and the planned buckets' flat blocks, with one
    commit, rollback and state_dict; no other file of memory/ makes a tensor, and the exchange's
    buckets and FSDP's groups keep theirs in a Carried (no double buffer of their own)."""
    from redsync_hvd.memory import AdamUnitsMemory, Carried, MomentumCorrectionMemory, ResidualMemory
    made = [f"{p.name}:{n.lineno}" for p in sorted((PKG / "memory").glob("*.py")) if p.name != "state.py"
            for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", None) in ("zeros", "zeros_like", "empty", "empty_like", "clone")]
    assert not made, made
    mems = [ResidualMemory(), MomentumCorrectionMemory(0.9), AdamUnitsMemory({"w": (0.9, 0.99)}, {"w": 1e-8})]
    for mem in mems:
        for _ in range(2):
            mem.compensate("w", torch.randn(100))
            mem.commit()
        kept = {id(t) for t in _tensors(mem.state)}
        assert isinstance(mem.state, Carried) and kept and all(id(t) in kept for t in _tensors(mem)), mem
        assert mem.state_dict().keys() == mem.state.state_dict().keys()
    import redsync_hvd.torch as rhvd
    model = net()
    opt = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(), compression=SPEC,
                                    communicator=LocalCommunicator(2))
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
    ex = opt.exchange
    (planned,) = ex.planned
    assert planned.block is ex.memory.state.blocks[planned.key]
    assert ex.residuals().keys() == set(planned.names) <= ex.residuals("velocity").keys()   # dense layers' u too
    assert not hasattr(ex, "memories")
    for path in [EXCHANGE / f"{m}.py" for m in ("planned", "scatter", "sharded")] + [PKG / "torch" / "fsdp.py"]:
        text = path.read_text()
        assert not any(word in text for word in ("swap(", "FlatPair", "_kept_x")), path


# -- one selection: the entry point, and torch.topk only in core/ ----------------------------------
SELECT = "redsync_hvd.core.select"
# what exchange/ and compressors/ may take from the selection package: the entry point, its types,
# the radix strategy's first and last passes, and the helpers of the sign rule and the registry
ENTRY = {"select", "single", "Contract", "SelectionState", "NonFiniteError", "scan_request", "compensate",
         "HistogramRequest", "decode_add", "keep_side", "kept_mean", "backends", "pick", "check"}


def _imports(path: Path) -> list:
    """(module, name) of every ``from ... import name`` in a package file, made absolute."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            base = package.rsplit(".", n.level - 1)[0] if n.level else ""
            module = ".".join(p for p in (base, n.module) if p)
            out += [(module, a.name) for a in n.names]
    return out


def test_exchange_and_compressors_select_through_the_one_entry_point():
    """exchange/ and compressors/ take from core/select only the entry point and its types (no
    strategy, backend or kernel module of it), and both call ``select``."""
    callers, wrong = set(), []
    for folder in ("exchange", "compressors"):
        for path in sorted((PKG / folder).glob("*.py")):
            for module, name in _imports(path):
                if module.startswith(SELECT) and (name not in ENTRY or module.rsplit(".", 1)[-1]
                                                  not in ("select", "registry", "reference")):
                    wrong.append(f"{folder}/{path.name}: {module}.{name}")
            if any(getattr(n.func, "id", None) == "select" for n in ast.walk(ast.parse(path.read_text()))
                   if isinstance(n, ast.Call)):
                callers.add(folder)
    assert not wrong, wrong
    assert callers == {"exchange", "compressors"}, callers


def test_no_topk_outside_core():
    """Every top-k of the package goes through core/ (the exact strategy of core/select)."""
    outside = [p for p in sorted(PKG.rglob("*.py")) if p.relative_to(PKG).parts[0] != "core"]
    hits = [f"{p.relative_to(PKG)}:{n.lineno}" for p in outside for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.Attribute) and n.attr == "topk"]
    assert not hits, hits
