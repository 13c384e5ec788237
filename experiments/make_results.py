"""Write docs/results.md from the measurement records in docs/results/*.json.

    python experiments/make_results.py            # rewrite docs/results.md
    python experiments/make_results.py --check    # exit 1 if docs/results.md is not what the records give

A record is one figure set, measured in one sitting on one CPU with one command:

    {
      "id": "xeon-amx-tiny-demo",                  # = the file name without .json
      "family": "Intel Xeon with AMX",             # a family of docs/results/families.json
      "order": 1,                                  # optional: position among its family's records
      "pair": "tiny",                              # "smollm2" (SmolLM2-135M-Instruct + its draft) or "tiny"
      "title": "verispec demo: greedy speedup of each method over plain decoding",
      "threads": 1,                                # torch threads of the measured process
      "commit": "7f6c8d7",                         # the revision measured (null, with "commit_note", if unknown)
      "date": "2026-12-02",
      "command": ["verispec demo --target tiny"],  # every command behind the figures, as a user would type it
      "setup": "what was measured and how (prompts, tokens, repeats)",
      "columns": ["workload", "chain", ...],       # one table
      "rows": [["code", "1.58x", ...], ...],
      "notes": ["..."],                            # optional
      "raw": "docs/results/....report.md"          # optional: the tool's own output, committed beside it
    }

JSON files in docs/results/ without a "family" field are raw outputs of a tool (for example
``experiments/smollm2_peers.py --out``), not records: they are not rendered, and a record cites one
with "raw". Only current figures belong here: when code or a shipped model changes what a record
measured, re-measure and replace the record (git keeps the old one). Families are listed in
docs/results/families.json in the order the page shows them; every family gets a section for each
pair, with the marker ``<!-- SMOLLM2 RESULTS -->`` where SmolLM2 records go, so a family without them
is visibly open. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "docs" / "results"
OUT = ROOT / "docs" / "results.md"
PAIRS = {"smollm2": "SmolLM2-135M-Instruct with its shipped draft", "tiny": "The tiny embedded pair"}
REQUIRED = ("id", "family", "pair", "title", "threads", "commit", "date", "command", "setup", "columns", "rows")
SMOLLM2_MARKER = "<!-- SMOLLM2 RESULTS -->"


def load_records(folder: Path) -> list[dict]:
    records = []
    for path in sorted(folder.glob("*.json")):
        if path.name == "families.json":
            continue
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or "family" not in record:
            continue  # a tool's raw output kept beside the records (a record points at it with "raw")
        missing = [key for key in REQUIRED if key not in record]
        if missing:
            raise SystemExit(f"{path}: missing {', '.join(missing)}")
        if record["id"] != path.stem:
            raise SystemExit(f"{path}: id {record['id']!r} differs from the file name")
        if record["pair"] not in PAIRS:
            raise SystemExit(f"{path}: pair must be one of {', '.join(PAIRS)}, got {record['pair']!r}")
        if record["commit"] is None and not record.get("commit_note"):
            raise SystemExit(f"{path}: a null commit needs a commit_note saying what was measured")
        width = len(record["columns"])
        for row in record["rows"]:
            if len(row) != width:
                raise SystemExit(f"{path}: row {row} has {len(row)} cells for {width} columns")
        records.append(record)
    return records


def table(columns: list[str], rows: list[list[str]]) -> list[str]:
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]


def render_record(record: dict) -> list[str]:
    commit = f"`{record['commit']}`" if record["commit"] else f"not recorded ({record['commit_note']})"
    lines = [f"#### {record['title']}", "",
             f"*{record['family']}, {record['threads']} torch thread{'s' if record['threads'] != 1 else ''}, "
             f"commit {commit}, {record['date']}; record `docs/results/{record['id']}.json`.*", "",
             "```bash", *record["command"], "```", "", record["setup"], "",
             *table(record["columns"], record["rows"]), ""]
    lines += [f"- {note}" for note in record.get("notes", [])]
    if record.get("raw"):
        lines.append(f"- Raw output: [{Path(record['raw']).name}]({Path(record['raw']).relative_to('docs')}).")
    if record.get("notes") or record.get("raw"):
        lines.append("")
    return lines


def render(families: list[dict], records: list[dict]) -> str:
    known = [f["family"] for f in families]
    unknown = sorted({r["family"] for r in records} - set(known))
    if unknown:
        raise SystemExit(f"families not in docs/results/families.json: {', '.join(unknown)}")
    lines = ["# Results", "",
             "<!-- Generated by `python experiments/make_results.py` from docs/results/*.json: edit the records, "
             "not this page. -->", "",
             "Current figures only, one section per CPU family, each with the command that produced it, the commit "
             "measured and the date. Ratios are measured side by side in one run on one machine; absolute times "
             "are per machine and should not be compared across sections. Older figures, for code or models that "
             "no longer ship, are in git history. How to add a figure: [below](#adding-a-figure).", ""]
    for family in families:
        lines.append(f"- [{family['family']}](#{family['slug']})")
    lines.append("")
    for family in families:
        mine = [r for r in records if r["family"] == family["family"]]
        lines += [f'<a id="{family["slug"]}"></a>', "", f"## {family['family']}", "", family["description"], ""]
        for pair, label in PAIRS.items():
            lines += [f"### {label}", ""]
            if pair == "smollm2":
                lines += [SMOLLM2_MARKER, ""]
            chosen = sorted((r for r in mine if r["pair"] == pair), key=lambda r: (r.get("order", 1000), r["id"]))
            if not chosen:
                lines += ["No current figures recorded.", ""]
            for record in chosen:
                lines += render_record(record)
    lines += ["## Adding a figure", "",
              "Write one JSON record per figure set into `docs/results/` (the fields are described at the top of "
              "`experiments/make_results.py`; copy an existing record), name the CPU family from "
              "`docs/results/families.json` (add a family there for a new kind of CPU or accelerator), and run "
              "`python experiments/make_results.py`. A record that a new measurement supersedes is replaced, "
              "not kept beside it. Summarise in the README's results table only what a user choosing a method "
              "needs.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is out of date")
    args = parser.parse_args(argv)
    families = json.loads((RECORDS / "families.json").read_text())
    text = render(families, load_records(RECORDS))
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run python experiments/make_results.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
