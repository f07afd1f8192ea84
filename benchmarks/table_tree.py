"""A copy of this tree's ``src`` with edits to an arch's config table, for A/B runs.

    python3 benchmarks/table_tree.py /tmp/ipdq --set medium_window.backward.redo_in_program=true \\
        --set medium_window.backward.dq_maxnreg=128 [--set dependent_launch=true] [--arch sm90]

Copies ``src`` to ``DEST/src`` (replacing it) and sets, in ``DEST/src/na3d/configs/<arch>.json``,
each ``PATH=VALUE``: ``PATH`` a top-level key of the table, or a bucket's name (``bucket/option``
for one of its ``alternatives``, as ``configs`` names them: ``dit_large_window/deep_boxes``)
followed by the keys inside its entry (created where missing); ``VALUE`` JSON. Run the tree with
``PYTHONPATH=DEST/src``. Earlier session scripts did the same with a heredoc each.
"""

import argparse
import json
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest")
    parser.add_argument("--arch", default="sm90")
    parser.add_argument("--set", dest="edits", action="append", default=[], metavar="PATH=VALUE")
    args = parser.parse_args()

    src = os.path.join(args.dest, "src")
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(os.path.join(HERE, "..", "src"), src, ignore=shutil.ignore_patterns("__pycache__"))
    path = os.path.join(src, "na3d", "configs", f"{args.arch}.json")
    with open(path) as f:
        table = json.load(f)
    buckets = {entry["bucket"]: entry for entry in table["forward"]}
    for entry in table["forward"]:
        for option in entry.get("alternatives", []):
            buckets[f"{entry['bucket']}/{option['name']}"] = option
    for edit in args.edits:
        keys, _, value = edit.partition("=")
        first, *rest = keys.split(".")
        if first in buckets:
            node = buckets[first]
        elif not rest:
            node, rest = table, [first]
        else:
            raise SystemExit(f"--set {edit}: {first!r} is neither a bucket ({', '.join(buckets)}) nor a top-level key")
        for key in rest[:-1]:
            node = node.setdefault(key, {})
        node[rest[-1]] = json.loads(value)
    with open(path, "w") as f:
        f.write(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
