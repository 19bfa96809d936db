"""FlashInfer's fused all-reduce + residual add + RMSNorm (TensorRT-LLM's
allreduce-fusion kernels, `flashinfer.comm.trtllm_allreduce_fusion`) against
the unfused torch path (NCCL all_reduce, then x + residual, then
F.rms_norm), bf16, under CUDA graphs.

    python3 python/bench/bench_flashinfer_fusion.py --jit-only      # build the kernels once (one process)
    torchrun --nproc_per_node=2 python/bench/bench_flashinfer_fusion.py
    torchrun --nproc_per_node=2 python/bench/bench_flashinfer_fusion.py --hidden 4096 --tokens 1 128

Written against flashinfer-python 0.6.8 with apache-tvm-ffi 0.1.10 (the
wheels in .whl/); it uses keyword arguments only, so nearby versions work too.
The kernels are JIT-compiled with nvcc ($CUDA_HOME or /usr/local/cuda) into
$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default base here:
/tmp/ferrocomm_flashinfer), and the compile time is printed.

Method (as python/bench/bench_torch.py): each subject's call is captured K
(--ops-per-graph) times back to back into one CUDA graph after an eager
warm-up on a side stream; the graph is replayed --warmup times, then --iters
times after a barrier, each replay timed with CUDA events; us per op is the
median replay / K, the max of that over ranks. Rows:
  torch      ar               nccl_unfused  dist.all_reduce alone (reference)
  torch      ar_rmsnorm       nccl_unfused  all_reduce; x + residual; F.rms_norm
  torch      ar_rmsnorm_fp8   nccl_unfused  the same; (y / scale).clamp().to(fp8 e4m3)
  flashinfer ar_rmsnorm       default|oneshot|twoshot  kARResidualRMSNorm
  flashinfer ar_rmsnorm_fp8   default|oneshot|twoshot  kARResidualRMSNormFP8Quant
"default" passes use_oneshot=None (FlashInfer's heuristic, printed as
resolved=...); twoshot is only valid when tokens > world size
(trtllm_ar.py:986). The fused outputs after the timed replays are checked
against the unfused torch result (norm_out vs rms_norm output; for FP8,
fp8 * scale vs the same); a row out of tolerance is marked WRONG. A fused
variant that raises (on all ranks) is reported FAIL and skipped from then on.

SAFETY: this never creates NVLink multicast objects. NCCL NVLS, NVSHMEM NVLS
and torch symmetric-memory multicast are disabled by the environment below,
before torch is imported. The FlashInfer path used is the legacy TRT-LLM IPC
workspace: trtllm_create_ipc_workspace_for_all_reduce_fusion(...,
use_symm_dev_mem=False) -> cuda_ipc.create_shared_buffer = cudaMalloc +
cudaIpcGetMemHandle + cudaIpcOpenMemHandle (flashinfer 0.6.8 trtllm_ar.py:615,
cuda_ipc.py:197-222). cuMulticastCreate appears only in comm/mnnvl.py
(SymmDeviceMemory/McastDeviceMemory._setup_multicast), reached only through
use_symm_dev_mem=True or the MNNVL workspace, neither of which is used here;
the fusion kernels (trtllm_allreduce_fusion.cuh) contain no multimem/multicast
instruction.

If flashinfer cannot be imported or its JIT build fails, a line
`FLASHINFER UNAVAILABLE: <reason>` is printed, the torch rows still run, and
the exit status is 0 (--jit-only exits 1 instead, so a build step can be chained).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import traceback
import warnings

# Before torch/NCCL are loaded: no NVLink multicast (NVLS) anywhere.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
# FlashInfer (jit/env.py:51) and tvm-ffi read these at import: keep caches under /tmp.
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/ferrocomm_flashinfer")
os.environ.setdefault("TVM_FFI_CACHE_DIR", "/tmp/ferrocomm_flashinfer/tvm-ffi")
# FLASHINFER_JIT_VERBOSE=1 alone would also build with -O0 -G (jit/core.py gen_jit_spec); pin it off.
os.environ.setdefault("FLASHINFER_JIT_DEBUG", "0")
# The legacy fusion entry points are marked @deprecated; one warning per call is noise.
warnings.filterwarnings("ignore", category=DeprecationWarning)

EPS = 1e-6
FP8_SCALE = 0.025  # dequant scale: |norm| stays < ~8, so |norm / scale| < 448 (e4m3 max)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 128, 2048])
    p.add_argument("--iters", type=int, default=20, help="timed graph replays (median)")
    p.add_argument("--warmup", type=int, default=5, help="untimed graph replays")
    p.add_argument("--ops-per-graph", type=int, default=20, help="K calls captured per graph")
    p.add_argument("--no-pdl", action="store_true", help="launch_with_pdl=False for the fused kernel")
    p.add_argument("--no-flashinfer", action="store_true", help="torch rows only")
    p.add_argument("--jit-only", action="store_true",
                   help="one process: import flashinfer, build the trtllm_comm kernels, exit")
    return p.parse_args(argv)


def ensure_build_tools():
    """FlashInfer's JIT runs `ninja` and $CUDA_HOME/bin/nvcc; make both findable."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # the pip package ships the binary in ninja.BIN_DIR
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ["PATH"]
        except ImportError:
            pass
    if "CUDA_HOME" not in os.environ and shutil.which("nvcc") is None:
        if os.path.exists("/usr/local/cuda/bin/nvcc"):
            os.environ["CUDA_HOME"] = "/usr/local/cuda"


def load_flashinfer(torch):
    """Import flashinfer.comm and build/load the trtllm_comm module.
    Returns (module or None, reason or None). Two ranks building at once is
    safe: flashinfer serializes build_and_load with a FileLock (jit/core.py)."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    # Target only this GPU's arch (9.0 -> sm_90a); must be set before import (compilation_context.py:63).
    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", f"{major}.{minor}")
    ensure_build_tools()
    try:
        import flashinfer
        import flashinfer.comm as fic
        from flashinfer.comm import trtllm_ar
    except Exception as e:  # noqa: BLE001 - any import problem means "unavailable"
        traceback.print_exc()
        return None, f"import failed: {type(e).__name__}: {e}"
    try:
        spec = fic.gen_trtllm_comm_module()
        cached = spec.is_compiled
        where = spec.jit_library_path
    except Exception:  # noqa: BLE001 - informational only
        cached, where = None, "?"
    if not cached:
        print(f"[rank {os.environ.get('RANK', '0')}] building trtllm_comm with nvcc "
              f"(arch {os.environ['FLASHINFER_CUDA_ARCH_LIST']}; minutes the first time)...", flush=True)
    t0 = time.time()
    try:
        trtllm_ar.get_trtllm_comm_module()  # nvcc + ninja build, then tvm_ffi.load_module
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()  # the full ninja/nvcc output is in the exception text
        lines = str(e).strip().splitlines() or [""]
        msg = " | ".join([ln for ln in lines if "error" in ln.lower()][:4] or lines[-6:])
        return None, f"JIT build/load failed after {time.time() - t0:.0f}s: {type(e).__name__}: {msg}"
    print(f"[rank {os.environ.get('RANK', '0')}] flashinfer {flashinfer.__version__}: trtllm_comm JIT "
          f"{'was cached' if cached else 'compiled'} in {time.time() - t0:.1f}s -> {where}", flush=True)
    return fic, None


def graph_time(torch, dist, fn, k, warmup, iters, pre=None):
    """Median us per op of `fn` captured `k` times in one graph (max over ranks).
    `pre` runs before every replay, untimed (refills the in-place NCCL buffer)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            if pre:
                pre()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    if pre:
        pre()
    with torch.cuda.graph(g):
        for _ in range(k):
            fn()
    for _ in range(warmup):
        if pre:
            pre()
        g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(iters):
        if pre:
            pre()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / k)
    del g
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def all_ranks_ok(torch, dist, ok):
    """Collective AND of a per-rank flag, so every rank takes the same branch."""
    t = torch.tensor([1 if ok else 0], device="cuda", dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def main(argv=None):
    args = parse_args(argv)
    import torch

    if args.jit_only:
        fic, why = load_flashinfer(torch)
        if fic is None:
            print(f"FLASHINFER UNAVAILABLE: {why}", flush=True)
        return 0 if fic is not None else 1

    import torch.distributed as dist
    import torch.nn.functional as F
    from datetime import timedelta

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    # JIT before the process group exists: a long first compile cannot trip NCCL timeouts.
    fic, why = (None, "disabled by --no-flashinfer") if args.no_flashinfer else load_flashinfer(torch)
    dist.init_process_group("nccl", timeout=timedelta(minutes=20),
                            device_id=torch.device("cuda", local_rank))
    rank, ws = dist.get_rank(), dist.get_world_size()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    if fic is not None and ws not in (2, 4, 8, 16):
        fic, why = None, f"world size {ws} not in (2, 4, 8, 16) (trtllm_allreduce_fusion.cuh:1572)"
    if not all_ranks_ok(torch, dist, fic is not None):
        say(f"FLASHINFER UNAVAILABLE: {why or 'failed on another rank'}")
        fic = None
    nccl = torch.cuda.nccl.version()
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    say(f"torch {torch.__version__} cuda {torch.version.cuda} nccl {nccl} "
        f"gpu {torch.cuda.get_device_name()} world {ws} K={args.ops_per_graph} iters={args.iters} "
        f"pdl={not args.no_pdl}")
    Pat = fic.AllReduceFusionPattern if fic is not None else None
    bf16, dev = torch.bfloat16, torch.device("cuda", local_rank)
    results = []
    dead = set()  # fused variants that failed on all ranks once: not retried (state may be bad)
    header = f"{'impl':<11}{'hidden':>7}{'tokens':>7}  {'pattern':<16}{'variant':<26}{'us/op':>9}  check"
    say(header + "\n" + "-" * len(header))

    def report(impl, h, t, pattern, variant, us, check, extra=""):
        line = (f"RESULT {impl} h={h} t={t} pattern={pattern} variant={variant} "
                f"us={us:.2f} check={check.split()[0]}{extra}")
        results.append(line)
        shown = variant + extra.replace(" ", "(", 1) + ")" if extra else variant
        say(f"{impl:<11}{h:>7}{t:>7}  {pattern:<16}{shown:<26}{us:>9.2f}  {check}")

    def check(out, ref, rtol, atol):
        diff = (out.float() - ref.float()).abs().max().item()
        ok = torch.allclose(out.float(), ref.float(), rtol=rtol, atol=atol)
        ok = all_ranks_ok(torch, dist, ok)
        return f"{'ok' if ok else 'WRONG'} maxdiff={diff:.3g}"

    for h in args.hidden:
        workspace = None
        if fic is not None:
            try:  # legacy cudaIpc workspace (never multicast), sized for the largest token count
                res = fic.trtllm_create_ipc_workspace_for_all_reduce_fusion(
                    rank, ws, max(args.tokens), h, use_fp32_lamport=False,
                    group=dist.group.WORLD, create_metadata=True)
                workspace = (res[0], res[1], res[-1] if isinstance(res[-1], dict) else None)
                ok = True
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                ok, why = False, f"workspace creation failed: {type(e).__name__}: {e}"
            if not all_ranks_ok(torch, dist, ok):
                say(f"FLASHINFER UNAVAILABLE: {why if not ok else 'workspace failed on another rank'}")
                fic, workspace = None, None
        for t in args.tokens:
            # Inputs differ per rank; residual and gamma are replicated, as in a TP model.
            gen = torch.Generator(device=dev).manual_seed(1000 + rank)
            inp = torch.randn(t, h, dtype=bf16, device=dev, generator=gen)
            gen.manual_seed(7)
            residual = torch.randn(t, h, dtype=bf16, device=dev, generator=gen)
            gamma = (1.0 + 0.1 * torch.randn(h, device=dev, generator=gen)).to(bf16)
            scale = torch.tensor([FP8_SCALE], dtype=torch.float32, device=dev)

            # Reference (the unfused path, eager): all_reduce, add, rms_norm.
            ref_ar = inp.clone()
            dist.all_reduce(ref_ar)
            ref_res = ref_ar + residual
            ref_norm = F.rms_norm(ref_res, (h,), gamma, EPS)

            # Unfused torch rows. all_reduce is in place, so `buf` is refilled before every replay.
            buf = torch.empty_like(inp)
            refill = lambda: buf.copy_(inp)  # noqa: E731
            torch_subjects = {
                "ar": lambda: dist.all_reduce(buf),
                "ar_rmsnorm": lambda: (dist.all_reduce(buf), F.rms_norm(buf + residual, (h,), gamma, EPS)),
                "ar_rmsnorm_fp8": lambda: (dist.all_reduce(buf), (F.rms_norm(buf + residual, (h,), gamma, EPS)
                                           / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)),
            }
            for name, fn in torch_subjects.items():
                us = graph_time(torch, dist, fn, args.ops_per_graph, args.warmup, args.iters, pre=refill)
                report("torch", h, t, name, "nccl_unfused", us, "n/a")

            if fic is None:
                continue
            _, ws_tensor, meta = workspace
            res_out = torch.empty_like(inp)
            norm_out = torch.empty_like(inp)
            quant_out = torch.empty(t, h, dtype=torch.uint8, device=dev)  # fp8 bytes; uint8 keeps DLPack simple
            try:
                heuristic = fic.trtllm_ar._should_use_oneshot(t, h, bf16, ws)  # private; display only
                resolved = "oneshot" if heuristic else "twoshot"
            except Exception:  # noqa: BLE001
                resolved = "?"
            variants = [("default", None), ("oneshot", True)]
            if t > ws:  # twoshot asserts token_num > world_size (trtllm_ar.py:986)
                variants.append(("twoshot", False))
            patterns = [("ar_rmsnorm", Pat.kARResidualRMSNorm, False),
                        ("ar_rmsnorm_fp8", getattr(Pat, "kARResidualRMSNormFP8Quant", None), True)]
            for pname, pattern, fp8 in [p for p in patterns if p[1] is not None]:
                for vname, use_oneshot in variants:
                    if vname in dead:
                        continue
                    extra = f" resolved={resolved}" if use_oneshot is None else ""

                    def fused(pattern=pattern, fp8=fp8, use_oneshot=use_oneshot):
                        fic.trtllm_allreduce_fusion(
                            allreduce_in=inp, world_size=ws, world_rank=rank, token_num=t, hidden_dim=h,
                            workspace_ptrs=ws_tensor, launch_with_pdl=not args.no_pdl,
                            use_oneshot=use_oneshot, trigger_completion_at_end=True, fp32_acc=True,
                            pattern_code=pattern, allreduce_out=None, residual_in=residual,
                            residual_out=res_out, norm_out=None if fp8 else norm_out,
                            quant_out=quant_out if fp8 else None, scale_out=None, rms_gamma=gamma,
                            rms_eps=EPS, scale_factor=scale if fp8 else None, layout_code=None,
                            metadata=meta)

                    try:
                        norm_out.zero_(), quant_out.zero_(), res_out.zero_()
                        us = graph_time(torch, dist, fused, args.ops_per_graph, args.warmup, args.iters)
                        torch.cuda.synchronize()
                        if fp8:
                            deq = quant_out.view(torch.float8_e4m3fn).float() * FP8_SCALE
                            verdict = check(deq, ref_norm, rtol=0.13, atol=0.01)  # e4m3: 3 mantissa bits
                        else:
                            verdict = check(norm_out, ref_norm, rtol=2e-2, atol=3e-2)  # bf16: ~1 ulp
                        verdict += f" resid_maxdiff={(res_out.float() - ref_res.float()).abs().max().item():.3g}"
                        ok = True
                    except Exception as e:  # noqa: BLE001 - report the row, keep going if all ranks agree
                        traceback.print_exc()
                        us, verdict, ok = float("nan"), f"FAIL {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}", False
                    report("flashinfer", h, t, pname, vname, us, verdict, extra)
                    if not all_ranks_ok(torch, dist, ok):
                        say(f"flashinfer variant {vname} failed; its later rows are skipped")
                        dead.add(vname)
        if workspace is not None and fic is not None:
            torch.cuda.synchronize()
            fic.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(workspace[0], group=dist.group.WORLD)

    say("")
    for line in results:
        say(line)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
