"""Data-parallel Seq2SeqTrainer evaluation on two GPUs: 2 processes give 1 process's predictions (issue 11).

Runs ``examples/seq2seq_eval.py`` (Seq2SeqTrainer, predict_with_generate, beam search; stock sdpa and
cascade in each run) twice on a random model of bart-large-cnn's shape built from its config (no download:
``--model ''``): once in one process, once under ``torchrun --nproc-per-node 2`` (NCCL on cuda, gloo on
the CPU). Checks that the two-process predictions equal the one-process ones, for the cascade model and
for stock (a two-process evaluation hands each process whole batches of the one-process run, so the same
batch shapes reach the same kernels), and reports wall times, the Trainer's predict seconds and the
attention K/V each side held. Writes ``encdec_dp.json`` and ``encdec_dp.log`` (plus each run's JSON) to
``$OUT`` (``./out`` if unset); exits 1 when the cascade predictions of 2 processes differ from 1 process's.

    PYTHONPATH=. python benchmarks/encdec_dp_gpu.py                        # 2 x GPU, bf16, bart-large-cnn shape
    PYTHONPATH=. python benchmarks/encdec_dp_gpu.py --device cpu --shape tiny --dtype float32   # dry run, gloo

Defaults (GPU): 64 examples with random sources of up to 1024 tokens, batch 8 per process, 4 beams, 64 new
tokens; about 1-2 minutes on two H200s (mostly process start-up and model building).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import harness  # noqa: E402


def _run(cmd, env, timeout) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a child process; 124 when it ran past ``timeout`` seconds."""
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as err:
        stdout, stderr = err.stdout or "", err.stderr or ""
        return (124, *(x.decode() if isinstance(x, bytes) else x for x in (stdout, stderr)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="bart-large-cnn", choices=["bart-large-cnn", "tiny"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64", "float16"])
    p.add_argument("--examples", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="per process (and for the one-process run)")
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--source-len", type=int, default=1024)
    p.add_argument("--timeout", type=int, default=600, help="seconds for each of the two runs")
    args = p.parse_args(argv)
    out = Path(os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "encdec_dp.log", "w")

    def say(text):
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    common = ["--model", "", "--shape", args.shape, "--dtype", args.dtype, "--examples", str(args.examples),
              "--batch", str(args.batch), "--beams", str(args.beams), "--new", str(args.new),
              "--source-len", str(args.source_len), "--device", args.device]
    example = str(ROOT / "examples" / "seq2seq_eval.py")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):   # NVLink multicast stays off (shared GPU hosts)
        env.setdefault(name, value)
    runs = {}
    for name, launcher in (("one", [sys.executable]),
                           ("two", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                    "--master-port", str(29500 + os.getpid() % 1000)])):
        cmd = [*launcher, example, *common, "--out", str(out / f"encdec_dp_{name}.json")]
        run_env = dict(env)
        if name == "one" and args.device == "cuda":
            run_env["CUDA_VISIBLE_DEVICES"] = run_env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        # logged as run from the repository (no path of the machine it ran on)
        shown = ["python", *launcher[1:], os.path.relpath(example, ROOT), *common,
                 "--out", f"$OUT/encdec_dp_{name}.json"]
        say(f"$ {' '.join(shown)}")
        wall, (rc, stdout, stderr) = harness.timed(lambda: _run(cmd, run_env, args.timeout))
        say(stdout.rstrip())
        if rc:
            say(stderr[-8000:].rstrip())
        say(f"[{name}] exit {rc}, wall {wall:.1f} s")
        runs[name] = dict(rc=rc, wall_s=round(wall, 2))
        if rc == 0:
            runs[name].update(json.loads((out / f"encdec_dp_{name}.json").read_text()))
    ok = all(r["rc"] == 0 for r in runs.values())
    record = harness.run_record(__file__, argv)
    result = dict(record, git_commit=record["commit"],          # git_commit: the field's name before the harness
                  device=args.device, shape=args.shape, dtype=args.dtype, examples=args.examples,
                  batch_per_process=args.batch, beams=args.beams, new_tokens=args.new, source_len=args.source_len)
    try:
        import torch
        import transformers
        gpu = torch.cuda.get_device_name(0) if args.device == "cuda" and torch.cuda.is_available() else None
        result.update(transformers=transformers.__version__, gpu=gpu)
    except Exception:            # the report still gets written
        pass
    if ok:
        one, two = runs["one"], runs["two"]
        checks = {
            "cascade_two_equals_one": two["cascade"]["predictions"] == one["cascade"]["predictions"],
            "stock_two_equals_one": two["stock"]["predictions"] == one["stock"]["predictions"],
            "cascade_equals_stock_one": one["cascade"]["predictions"] == one["stock"]["predictions"],
            "cascade_equals_stock_two": two["cascade"]["predictions"] == two["stock"]["predictions"],
            "predictions": len(one["cascade"]["predictions"]),
        }
        result.update(checks=checks, runs={
            name: dict(rc=r["rc"], wall_s=r["wall_s"], world_size=r.get("world_size"),
                       **{side: r[side]["metrics"] for side in ("stock", "cascade")}) for name, r in runs.items()})
        for name, r in runs.items():
            s, c = r["stock"]["metrics"], r["cascade"]["metrics"]
            say(f"{name} process(es): wall {r['wall_s']} s; predict stock {s['seconds']} s, cascade {c['seconds']} s "
                f"({s['seconds'] / max(c['seconds'], 1e-9):.2f}x); attention KV (rank 0) stock {s['kv_mib']} MiB, "
                f"cascade {c['kv_mib']} MiB")
        say("checks: " + json.dumps(checks))
        ok = checks["cascade_two_equals_one"] and checks["predictions"] == args.examples
    else:
        result.update(runs={name: dict(rc=r["rc"], wall_s=r["wall_s"]) for name, r in runs.items()})
    result["ok"] = bool(ok)
    harness.write_json(out / "encdec_dp.json", result)
    say(f"{'OK' if ok else 'FAILED'}: results in {out / 'encdec_dp.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
