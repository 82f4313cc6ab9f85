"""`decentrl bench weights`: delta size on a real RL run, exactness, codec speed, peer fan-out.

1. **Run replay** (`--run-dir` of a finished `decentrl demo`, or a short demo run here): every
   retained manifest of the run is re-applied from the coordinator's chunk store, each version's
   reconstructed state checked against its signed hash, the last one also against the trainer's
   checkpoint cast to the inference dtype. `delta_bytes_ratio` is the median over consecutive
   versions of delta payload bytes / full snapshot bytes in the inference dtype (uncompressed).
   Catch-up after k versions is reported two ways: the bytes of the route the planner picks for a
   worker k versions behind (deltas, or a snapshot and deltas), and a direct delta between states
   k versions apart (what a coordinator could serve if it merged deltas; not built).
2. **Codec speed** on a synthetic state of `--state-mb` (>= 500 MB of bf16) whose changed fraction
   is the run's median: MB of state per second to encode a delta and to apply it.
3. **Fan-out** (`bench/weights_fanout.py`): 32 workers reach a new version from the coordinator
   alone vs. with peer relay, on loopback with token-bucket-limited uploads.

Progress on stderr, one JSON object on the last line of stdout.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from decentrl.cli import Parser
from decentrl.protocol import WeightsEntry
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.codec import (
    DTYPES,
    count_changed,
    decode_state,
    encode_state,
    published_state,
    state_hash,
)
from decentrl.weights.manifest import Manifest, check_layout
from decentrl.weights.planner import plan

CATCH_UP = (1, 10, 100)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_manifests(run_dir: Path) -> dict[tuple[int, str], Manifest]:
    paths = sorted((run_dir / "weights" / "manifests").glob("v*.json"))
    manifests = [Manifest.model_validate_json(path.read_bytes()) for path in paths]
    for manifest in manifests:
        problem = check_layout(manifest)
        if problem:
            raise SystemExit(f"decentrl: error: {manifest.version} {manifest.kind}: {problem}")
    return {(m.version, m.kind): m for m in manifests}


def replay_run(run_dir: Path) -> dict:
    """Re-apply every retained version of a run; sizes, exactness, catch-up ratios."""
    manifests = load_manifests(run_dir)
    store = ChunkStore(run_dir / "weights" / "chunks", durable=False)
    start = min(v for v, kind in manifests if kind == "snapshot")
    last = max(v for v, _ in manifests)
    state: dict[str, torch.Tensor] = {}
    decode_state(manifests[(start, "snapshot")].tensors, store.payload(manifests[(start, "snapshot")]), state)
    full_bytes = sum(t.numel() * t.element_size() for t in state.values())
    num_elements = sum(t.numel() for t in state.values())
    bit_exact = state_hash(state) == manifests[(start, "snapshot")].state_sha256
    ratios, fractions, history = [], [], {start: {k: v.clone() for k, v in state.items()}}
    direct: dict[int, list[float]] = {k: [] for k in CATCH_UP}
    chain: dict[int, list[float]] = {k: [] for k in CATCH_UP}
    index = [
        WeightsEntry(
            version=m.version, kind=m.kind, payload_bytes=m.payload_bytes, state_sha256=m.state_sha256
        )
        for m in manifests.values()
    ]
    for version in range(start + 1, last + 1):
        manifest = manifests[(version, "delta")]
        previous = history[version - 1]
        decode_state(manifest.tensors, store.payload(manifest), state)
        bit_exact &= state_hash(state) == manifest.state_sha256
        ratios.append(manifest.payload_bytes / full_bytes)
        fractions.append(count_changed(previous, state) / num_elements)
        history[version] = {k: v.clone() for k, v in state.items()}
        history.pop(version - max(CATCH_UP) - 1, None)
        for k in CATCH_UP:
            if version - k >= start and (version - k - start) % 10 == 0:  # every 10th start point
                chain[k].append(plan(version - k, version, index).num_bytes / full_bytes)
                direct[k].append(len(encode_state(history[version - k], state)[1]) / full_bytes)
        if version % 50 == 0:
            say(f"replay: v{version}/{last}, median delta ratio so far {statistics.median(ratios):.4f}")
    checkpoint = run_dir / "trainer" / "latest" / "model.safetensors"
    checkpoint_state = run_dir / "trainer" / "latest" / "state.json"
    matches_trainer = None
    if checkpoint.is_file() and json.loads(checkpoint_state.read_text())["policy_version"] == last:
        from safetensors.torch import load_file

        trained = published_state(load_file(str(checkpoint)), manifests[(last, "delta")].dtype)
        matches_trainer = state_hash(trained) == state_hash(state)
        bit_exact &= matches_trainer
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
    trainer = config.get("trainer", {})
    return {
        "delta_bytes_ratio": statistics.median(ratios),
        "delta_bytes_ratio_p90": sorted(ratios)[int(0.9 * (len(ratios) - 1))],
        "changed_fraction_median": statistics.median(fractions),
        "snapshot_zstd_ratio": manifests[(start, "snapshot")].payload_bytes / full_bytes,
        "catch_up_route_ratio": {str(k): statistics.median(v) for k, v in chain.items() if v},
        "catch_up_direct_ratio": {str(k): statistics.median(v) for k, v in direct.items() if v},
        "bit_exact": bit_exact,
        "final_matches_trainer_checkpoint": matches_trainer,
        "versions_replayed": last - start,
        "state_bytes": full_bytes,
        "dtype": manifests[(start, "snapshot")].dtype,
        "lr": trainer.get("lr"),
        "lr_schedule": f"warmup {trainer.get('lr_warmup_steps')} + {trainer.get('lr_decay')} to "
        f"{trainer.get('min_lr_ratio')} x lr over {trainer.get('num_steps')} steps",
    }


def codec_speed(state_mb: float, fraction: float, dtype: str = "bfloat16") -> dict:
    """Encode/decode throughput (MB of state per second) of one delta on a synthetic state."""
    size = DTYPES[dtype].itemsize
    rows = int(state_mb * 1e6 / size / 4096 / 16) + 1
    generator = torch.Generator().manual_seed(0)
    old, new = {}, {}
    for i in range(16):
        weight = torch.randn(rows, 4096, generator=generator) * 0.02
        moved = weight + 1e-3 * torch.randn(weight.shape, generator=generator) * (
            torch.rand(weight.shape, generator=generator) < fraction
        )
        old[f"w{i}"], new[f"w{i}"] = weight.to(DTYPES[dtype]), moved.to(DTYPES[dtype])
    total = sum(t.numel() * t.element_size() for t in new.values())
    started = time.perf_counter()
    entries, payload = encode_state(old, new)
    encode_s = time.perf_counter() - started
    started = time.perf_counter()
    decode_state(entries, payload, old)
    decode_s = time.perf_counter() - started
    started = time.perf_counter()
    exact = state_hash(old) == state_hash(new)
    hash_s = time.perf_counter() - started
    return {
        "encode_mb_s": total / 1e6 / encode_s,
        "decode_mb_s": total / 1e6 / decode_s,
        "hash_mb_s": total / 1e6 / hash_s,
        "speed_state_mb": total / 1e6,
        "speed_changed_fraction": fraction,
        "speed_delta_ratio": len(payload) / total,
        "speed_bit_exact": exact,
    }


def run_short_demo(run_dir: Path, steps: int, overrides: list[str]) -> None:
    """A demo RL run that keeps every version's manifest (what the replay needs)."""
    settings = [f"trainer.num_steps={steps}", "weights.keep_versions=100000", *overrides]
    command = [sys.executable, "-m", "decentrl", "demo", "--run-dir", str(run_dir)]
    command += [arg for setting in settings for arg in ("--set", setting)]
    say(f"running {' '.join(command[2:])}")
    subprocess.run(command, check=True, stdout=sys.stderr)


def main(argv: list[str]) -> int:
    parser = Parser(prog="decentrl bench weights", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", help="a finished demo run (default: run a short demo first)")
    parser.add_argument("--demo-steps", type=int, default=120, help="RL steps of the short demo")
    parser.add_argument(
        "--demo-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override of the short demo",
    )
    parser.add_argument("--state-mb", type=float, default=512.0, help="state size for codec speed")
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--payload-mb", type=float, default=4.0, help="size of the version fanned out")
    parser.add_argument("--upload-mb-s", type=float, default=8.0, help="upload cap of coordinator and peers")
    parser.add_argument("--skip-fanout", action="store_true")
    args = parser.parse_args(argv)
    if args.run_dir:
        run_dir = Path(args.run_dir)
        if not (run_dir / "weights" / "manifests").is_dir():
            print(
                f"decentrl: error: {run_dir} has no weights/manifests; pass the run dir of a decentrl demo",
                file=sys.stderr,
            )
            return 2
    else:
        run_dir = Path(tempfile.mkdtemp(prefix="bench-weights-"))
        run_short_demo(run_dir, args.demo_steps, args.demo_set)
    say(f"replaying {run_dir}")
    result = replay_run(run_dir)
    say(f"codec speed on {args.state_mb:.0f} MB, changed fraction {result['changed_fraction_median']:.4f}")
    result |= codec_speed(args.state_mb, result["changed_fraction_median"])
    if not args.skip_fanout:
        from decentrl.bench.weights_fanout import measure_fanout

        with tempfile.TemporaryDirectory(prefix="bench-fanout-") as root:
            result |= measure_fanout(Path(root), args.workers, args.payload_mb, args.upload_mb_s)
    result["run_dir"] = str(run_dir)
    print(json.dumps(result))
    return 0
