"""How long a server start takes: compile + capture of a budget ladder, in fresh processes, cold and warm caches.

Each start runs in a new Python process (nothing cached in memory). "cold": empty inductor and Triton cache
directories; "warm": a second process on the caches the cold one left. Per start it records the total seconds and
the runner's per-budget ``warmup_seconds`` (tracing and compiling happen there) and ``seconds``, for each
``compile_scope`` × ``compile_dynamic`` setting asked for. CUDA only. A diagnostic for comparing those settings: the
recorded start-up (``data/bench/capture.json``, the default setting) is made by ``python -m glmvit record``,
from the cold first and warm second process of a record run.

    python tools/capture_time.py --scopes blocks,model --dynamic auto,on --json /tmp/starts.json
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

DYNAMIC = {"auto": None, "on": True, "off": False}


def child(budgets: list[int], dynamic: str, scope: str, attn_backend: str | None) -> None:
    from glmvit import fingerprint

    fingerprint.start()  # before any glmvit code runs: the units it prints are what this start ran (Python 3.12+)
    import torch

    from glmvit.config import VisionConfig
    from glmvit.graphs import EncoderGraphRunner
    from glmvit.model import GlmVisionEncoder
    from glmvit.packing import BudgetConfig
    from glmvit.random_weights import randomize_

    start = time.perf_counter()
    model = GlmVisionEncoder(VisionConfig.glm41v(), attn_backend=attn_backend).to("cuda", torch.bfloat16).eval()
    randomize_(model, seed=0)
    built = time.perf_counter() - start
    runner = EncoderGraphRunner(model, BudgetConfig(tuple(budgets), 8, 16), torch_compile=True,
                                compile_dynamic=DYNAMIC[dynamic], compile_scope=scope)
    start = time.perf_counter()
    runner.capture()
    from glmvit.records import fingerprint_now

    print(json.dumps({"capture_s": time.perf_counter() - start, "model_s": built,
                      "attn_backend": model.attention_backend(),
                      "budgets": {str(k): v.as_dict() for k, v in runner.captures.items()},
                      "fingerprint": fingerprint_now().model_dump(mode="json")}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="64,128,256,512,768,1024", help="the ladder (default: six budgets)")
    p.add_argument("--dynamic", default="auto", help="compile_dynamic settings: comma list of auto, on, off")
    p.add_argument("--scopes", default="blocks,model", help="compile_scope settings: comma list of blocks, model")
    p.add_argument("--scope", default="blocks", help=argparse.SUPPRESS)
    p.add_argument("--attn-backend", default=None)
    p.add_argument("--json", required=True)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.child:
        child(budgets, args.child, args.scope, args.attn_backend)
        return
    from glmvit.provenance import collect
    from glmvit.records import Fingerprint, StartupRecord, make, to_json

    runs, fingerprint = {}, Fingerprint()
    for scope, dynamic in itertools.product(args.scopes.split(","), args.dynamic.split(",")):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            for start in ("cold", "warm"):
                cmd = [sys.executable, __file__, "--child", dynamic, "--scope", scope, "--budgets", args.budgets,
                       "--json", "-"]
                if args.attn_backend:
                    cmd += ["--attn-backend", args.attn_backend]
                t0 = time.perf_counter()
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                record = json.loads(out.strip().splitlines()[-1])
                record["process_s"] = time.perf_counter() - t0
                # the code the children ran is what the record measured
                fingerprint = fingerprint.merged(Fingerprint.model_validate(record.pop("fingerprint")))
                runs[f"{scope}-{dynamic}-{start}"] = record
                print(f"compile_scope={scope} compile_dynamic={dynamic} {start}: capture {record['capture_s']:.1f} s "
                      f"(process {record['process_s']:.1f} s)", flush=True)
    record = make(StartupRecord, provenance=collect("cuda", " ".join([sys.executable, *sys.argv])),
                  fingerprint=fingerprint, budgets=budgets, runs=runs)
    with open(args.json, "w") as f:
        f.write(to_json(record))


if __name__ == "__main__":
    main()
