"""The digest of every generated kernel source of the example models: a refactor of code that emits kernel text
must leave this list unchanged (`python tools/kernel_digests.py before.txt`, change, `... after.txt`, diff).

One line per kernel: spec, target, tensor-parallel degree, run dtype, kernel name, sha256 of the source (16 hex)
and of its catalogue key. No torch, no GPU, no AOT compile: ~2 minutes on one core."""
from __future__ import annotations

import argparse
import hashlib
import os

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import k3c  # noqa: E402
from k3c.codegen.catalogue import catalogue_kernels  # noqa: E402
from k3c.errors import K3cError  # noqa: E402

SPECS = ("examples/k3-tiny.yaml", "examples/k3-wide.yaml", "examples/kimi-k3.yaml", "examples/kimi-linear-48b.yaml")
TARGETS = ("h200", "mi355x", "b200")
LAYOUTS = ((1, None), (2, 2))


def digest_lines() -> list[str]:
    lines = []
    for spec in SPECS:
        for target in TARGETS:
            for tp, ep in LAYOUTS:
                m = k3c.compile(spec, target=target, tp=tp, ep=ep)
                for dt in ("bf16", "f32"):
                    where = f"{spec} {target} tp{tp} {dt}"
                    try:
                        kernels = catalogue_kernels(m.module, m.target, (dt,))
                    except K3cError as e:       # a combination the target refuses (native MX GEMMs take bf16)
                        lines.append(f"{where} REFUSED {type(e).__name__}: {e}")
                        continue
                    for ks in sorted(kernels, key=lambda k: (k.name, k.key)):
                        source = hashlib.sha256(ks.source.encode()).hexdigest()[:16]
                        lines.append(f"{where} {ks.name} {source} {ks.key[:16]}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="file to write the list to")
    args = ap.parse_args()
    lines = digest_lines()
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{len(lines)} lines -> {args.out}")


if __name__ == "__main__":
    main()
