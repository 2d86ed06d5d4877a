"""The load generator (bench-serve --url) is a process a record run starts per serve mode: what it imports before
it sends anything is time the run waits. It builds its workload and media bodies (each kind checked through the
server's own preprocessing) without importing transformers, torchvision or torch._dynamo (seconds of imports)."""
import json
import subprocess
import sys

HEAVY = ("transformers", "torchvision", "torch._dynamo")

CLIENT = f"""
import json, sys
from glmvit.cli import bench_serve
argv = ["--url", "http://127.0.0.1:9", "--workload", "video8x224", "--num-prompts", "2"]
parser = bench_serve.build_parser()
args = parser.parse_args(argv)
bench_serve.check_args(parser, args, argv)
bodies, made = bench_serve.media_bodies(bench_serve.build_workload(args), args.seed)
assert bodies and made
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r} or m.startswith({HEAVY!r}))))
"""


def test_the_client_path_imports_no_transformers_torchvision_or_dynamo():
    out = subprocess.run([sys.executable, "-c", CLIENT], capture_output=True, text=True, check=True, timeout=300)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_written_out_clip_normalisation_is_transformers():
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    from glmvit import processing

    assert processing.OPENAI_CLIP_MEAN == tuple(OPENAI_CLIP_MEAN)
    assert processing.OPENAI_CLIP_STD == tuple(OPENAI_CLIP_STD)
