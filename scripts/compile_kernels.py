#!/usr/bin/env python
"""Compile the Triton selection kernels (core/select/triton_select.py) for a GPU, without one.

    python scripts/compile_kernels.py              # every variant for sm_90 (H100/H200)
    python scripts/compile_kernels.py --quick      # the widest variant of each kernel
    python scripts/compile_kernels.py --arch 100   # another compute capability

Triton's interpreter (the CPU tests) accepts code the compiler rejects, so this compiles
each variant the launchers can ask for and prints its registers, spills and shared memory
(from the cubin, with the cuobjdump Triton ships) and how many 128-bit loads its PTX makes
(pointers 16-byte aligned, as for torch tensors). Exit status: 0 all compiled without
spills, 1 a variant failed or spills, 2 nothing could be compiled here (no CUDA backend).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)    # the kernels must be decorated for compilation

TILE = {"tile_seg": "*i32", "tile_lo": "*i64", "tile_hi": "*i64"}
CANDS = {"cand_bits": "*i32", "cand_pos": "*i32", "cand_lo": "*i64", "cand_n": "*i32"}
ROWS = {"prefix_ptr": "*i32", "need_ptr": "*i32"}


def _pass1(out, R, quick):
    for comp, mom, nes in ((True, True, True),) if quick else ((False, False, False), (True, False, False),
                                                               (True, True, False), (True, True, True)):
        out.append((f"_pass1 R={R} compensate={comp} momentum={mom} nesterov={nes}", "_pass1",
                    dict(x_ptr="*fp32", r_ptr="*fp32", g_ptr="*bf16", u_ptr="*fp32", uo_ptr="*fp32",
                         hist_ptr="*i32", **TILE, momentum="fp32"),
                    dict(COMPENSATE=comp, MOMENTUM=mom, NESTEROV=nes, R=R, ALIGNED=True, BLOCK=4096),
                    dict(num_warps=8, enable_fp_fusion=False)))


def _selection(out, R, s0, s1, mean, aligned):
    """The four launches after histogram 1 for one sign rule."""
    from redsync_hvd.core.segments import NONFINITE_BIN
    mags = mean or s1 != s0
    name = f"R={R} rows={s0},{s1} mean={mean} aligned={aligned}"
    out.append((f"_filter {name}", "_filter",
                dict(x_ptr="*fp32", hist1="*i32", hist2="*i32", k_ptr="*i32", **ROWS, zeros_ptr="*i32",
                     arrivals="*i32", bad_ptr="*i1", **CANDS, **TILE, seg_tile="*i32"),
                dict(NONFINITE=NONFINITE_BIN, CLEAR1=True, S0=s0, S1=s1, R=R, ALIGNED=aligned, BLOCK=2048),
                dict(num_warps=8)))
    out.append((f"_refine {name}", "_refine",
                dict(x_ptr="*fp32", hist3="*i32", k_ptr="*i32", **ROWS, zeros_ptr="*i32", arrivals="*i32",
                     sums="*fp64", mean_ptr="*fp32", side_ptr="*i8", kth_ptr="*i32", **CANDS, **TILE,
                     seg_tile="*i32"),
                dict(S0=s0, S1=s1, R=R, MAGS=mags, ALIGNED=aligned, BLOCK=1024), dict(num_warps=8)))
    out.append((f"_count {name}", "_count",
                dict(x_ptr="*fp32", **ROWS, side_ptr="*i8", arrivals="*i32", cnt_ptr="*i32", base_ptr="*i32",
                     **CANDS, **TILE, seg_tile="*i32"),
                dict(R=R, ALIGNED=aligned, BLOCK=1024), dict(num_warps=8)))


def _writes(out, R, quick):
    writes = [(True, True, True, "fp32"), (False, True, False, "bf16")] if quick else \
        [(False, False, False, "fp32"), (True, True, True, "fp32"), (False, True, True, "fp16"),
         (False, True, False, "bf16")]
    for mean, update, vel, vdt in writes:
        out.append((f"_write R={R} mean={mean} update={update} velocity={vel} values={vdt}", "_write",
                    dict(x_ptr="*fp32", u_ptr="*fp32", **ROWS, base_ptr="*i32", side_ptr="*i8", mean_ptr="*fp32",
                         offsets="*i64", kofs="*i64", pos_ptr="*i32", val_ptr="*" + vdt, **CANDS, **TILE,
                         limit="fp32"),
                    dict(R=R, MEAN=mean, UPDATE=update, VELOCITY=vel, BF16=vdt == "bf16", CLAMP=vdt != "fp32",
                         ALIGNED=True, BLOCK=1024),
                    dict(num_warps=8, enable_fp_fusion=False)))


def variants(quick: bool):
    """(name, kernel name, signature, constexprs, options) for each launch the launchers make."""
    out = []
    for R in (2,) if quick else (1, 2):
        _pass1(out, R, quick)
        if quick:
            rules = [(0, 1, True, True)]                  # "larger": both rows, with means
        elif R == 1:
            rules = [(0, 0, False, True), (0, 0, False, False)]
        else:
            rules = [(0, 0, True, True), (1, 1, True, True), (0, 1, True, True), (0, 1, False, False)]
        for s0, s1, mean, aligned in rules:
            _selection(out, R, s0, s1, mean, aligned)
        _writes(out, R, quick)
    for values, zero in ((True, True),) if quick else ((True, True), (True, False), (False, False)):
        out.append((f"_decode values={values} zero={zero}", "_decode",
                    dict(out_ptr="*fp32", zero_ptr="*fp32", pos_ptr="*i32", val_ptr="*fp16", mean_ptr="*fp32",
                         offsets="*i64", kofs="*i64", **TILE, K="i32", N="i32", L="i32", alpha="fp32"),
                    dict(HAS_VALUES=values, HAS_ZERO=zero, LOG=21, BLOCK=1024),
                    dict(num_warps=4, enable_fp_fusion=False)))
    return out


def resources(cubin: bytes, cuobjdump) -> str:
    if not cuobjdump:
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?SHARED:(\d+) LOCAL:(\d+)", text)
    return "registers %s, shared %s B, spilled %s B" % m.groups() if m else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="only the widest variant of each kernel")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: H100/H200)")
    args = p.parse_args()
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from redsync_hvd.core.select import triton_kernels, triton_select
    except ImportError as e:
        print("cannot compile here: %s" % e)
        return 2
    target = GPUTarget("cuda", args.arch, 32)
    found = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    bad = 0
    for name, kernel, sig, consts, opts in variants(args.quick):
        fn = getattr(triton_kernels, kernel, None) or getattr(triton_select, kernel)
        # pointers 16-byte aligned, as the launcher's specialisation tells the compiler for torch tensors
        aligned = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items() if v.startswith("*")}
        src = ASTSource(fn=fn, constexprs=consts, signature={**sig, **{k: "constexpr" for k in consts}}, attrs=aligned)
        try:
            compiled = triton.compile(src, target=target, options=opts)
        except Exception as e:   # noqa: BLE001 - report every variant, then fail
            if "0 active drivers" in str(e) or "backend" in str(e).lower() and "cuda" in str(e).lower():
                print("cannot compile here: %s" % e)
                return 2
            print("FAIL %-60s %s: %s" % (name, type(e).__name__, str(e).splitlines()[0][:300]))
            bad += 1
            continue
        res = resources(compiled.asm["cubin"], found[0] if found else None)
        spilled = re.search(r"spilled (\d+)", res)
        bad += bool(spilled and int(spilled.group(1)))
        wide = len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.", compiled.asm["ptx"]))
        print("ok   %-60s %s, 128-bit loads %d" % (name, res, wide))
    print("%d variant(s) failed or spill" % bad if bad else "all variants compiled for sm_%d" % args.arch)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
