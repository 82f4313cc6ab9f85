"""Benchmarks behind `decentrl bench NAME [ARGS]`: one module per benchmark, each with
`main(argv: list[str]) -> int`. Each prints progress on stderr and one JSON object on the last
line of stdout, so scripts can take `tail -n 1`.
"""

BENCHMARKS = {
    "staleness": "held-out accuracy vs max_staleness for each off-policy correction",
    "weights": "delta codec ratio, exactness and speed; peer fan-out speed-up",
    "adversarial": "hostile workers against a real coordinator: detection and quarantine",
    "sandbox": "sandbox throughput, attack containment and the tool-use run",
}
