"""Peak memory of ``train_phase2.py prepare``'s processes on 12-MP photos, by shard size.

A shard's samples stream into its Arrow writer (64 rows at a time), so a decoding process's
memory should not grow with ``--shard-size``. Side by side in one run: this tree, and with
``--compare-with REV`` the same command from an earlier commit (a git worktree, the same
interpreter), which held a whole shard's rows in memory before writing it.

Data: ``--lines`` index lines over ``--photos`` distinct 4000x3000 JPEGs (bench/data/data_scale.py's
phone photos: the photograph upscaled, with sensor noise), the shipped real config's data
settings with SigLIP-base's 224-px processor (pictures stored as uint8, 150 KB a sample).
Memory: each process's anonymous resident memory (its own heap; not the page cache of the
photos it reads), peak over samples every 0.1 s; 2 decoding processes.

    .venv/bin/python -m bench.data.prepare_memory --compare-with e9ed23d      # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from bench.common import REPO, machine, phone_photos, prepare_overrides, run_prepare, synthetic_tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=int, default=16, help="distinct 4000x3000 JPEGs (default: %(default)s)")
    parser.add_argument("--lines", type=int, default=512, help="index lines over them (default: %(default)s)")
    parser.add_argument("--shard-sizes", type=int, nargs="+", default=[64, 512], help="(default: %(default)s)")
    parser.add_argument("--compare-with", default=None, metavar="REV", help="also run prepare from this commit")
    args = parser.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepared_settings = prepare_overrides(work, synthetic_tokenizer(work / "tokenizer-set"))
        photos = phone_photos(work / "photos", args.photos).parent
        lines = [
            json.dumps(
                {"id": f"s{i}", "prompt": "Describe the photo.", "response": "A portrait.", "image": f"{i % args.photos}.jpg"}
            )
            for i in range(args.lines)
        ]
        index = photos / "lines.jsonl"
        index.write_text("\n".join(lines) + "\n")
        overrides = [*prepared_settings, f"data.train_index={index}"]
        trees = {"this tree": REPO}
        if args.compare_with:
            old = work / "old-tree"
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(old), args.compare_with], cwd=REPO, check=True, capture_output=True
            )
            trees[args.compare_with] = old
        try:
            print(f"\n{args.lines} samples over {args.photos} photos, 2 processes")
            print("| code | --shard-size | seconds | main process peak MiB | largest worker peak MiB |")
            print("|---|---|---|---|---|")
            for shard_size in args.shard_sizes:
                for name, tree in trees.items():
                    run = run_prepare(tree, overrides, work / "out", shard_size)
                    figures = f"{run['seconds']:.0f} | {run['main_mib']:.0f} | {run['worker_mib']:.0f}"
                    print(f"| {name} | {shard_size} | {figures} |", flush=True)
        finally:
            if args.compare_with:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees[args.compare_with])], cwd=REPO, check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
