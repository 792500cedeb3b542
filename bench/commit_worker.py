"""One commit's side of bench/bench_commits.py: run with that commit's checkout first on PYTHONPATH,
it reads one JSON list of `livedraft generate` arguments per stdin line, runs the command with
that commit's own code, and answers one JSON line: the command's summary and each prompt's
output ids. The target is loaded once and kept (whichever module of that commit loads targets),
so a case costs its decoding only. Not imported by anything else."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys


def _keep_targets() -> None:
    """Wraps the commit's load_target (online.loading, or online.models before it was renamed)."""
    for name in ("online.loading", "online.models"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "load_target"):
            loaded: dict[str, object] = {}
            original = mod.load_target

            def load_target(spec, cfg, args, _original=original, _loaded=loaded):  # noqa: ANN001, ANN202
                if spec not in _loaded:
                    _loaded[spec] = _original(spec, cfg, args)
                return _loaded[spec]

            mod.load_target = load_target
            return
    raise SystemExit("this commit has no load_target in online.loading or online.models")


def main() -> int:
    from online.cli import main as cli

    _keep_targets()
    out = sys.stdout
    for line in sys.stdin:
        argv = json.loads(line)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli(["generate", *argv, "--json"])
        rows = [json.loads(x) for x in buf.getvalue().splitlines() if x.startswith("{")]
        summary = next((r["summary"] for r in rows if "summary" in r), None)
        out.write(json.dumps({"rc": rc, "summary": summary,
                              "outputs": [r["output_ids"] for r in rows if "output_ids" in r]}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
