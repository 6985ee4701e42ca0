"""Build a release of llmgw: the wheel and sdist of llmgw.__version__ into --outdir, and
the release notes (CHANGELOG.md's "## Unreleased" under the version) beside them.

python scripts/release.py --outdir dist

Built without an isolated environment (setuptools and build come with `make install`),
so a release builds on a machine that reaches no package index.
"""

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "lib"))

from llmgw import __version__, releases  # noqa: E402
from llmgw.errors import Error  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outdir", default="dist", type=Path)
    args = ap.parse_args()
    outdir = args.outdir.absolute()
    try:
        text = releases.notes((ROOT / "CHANGELOG.md").read_text(), __version__)
    except Error as e:
        print(f"release: {e}", file=sys.stderr)
        return 1
    outdir.mkdir(parents=True, exist_ok=True)
    # setuptools builds in the tree (build/, *.egg-info); a copy keeps the checkout clean
    # and the release free of whatever else lies in it.
    with tempfile.TemporaryDirectory(prefix="llmgw-release-") as tmp:
        src = Path(tmp) / "src"
        files = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout.decode().split("\0")  # fmt: skip
        for name in filter(None, files):
            if (ROOT / name).is_file():
                (src / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, src / name)
        build = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(outdir)]
        result = subprocess.run([*build, str(src)], capture_output=True, text=True)
        if result.returncode != 0:
            print(result.stdout[-4000:] + result.stderr[-4000:], file=sys.stderr)
            print("release: the build failed (output above)", file=sys.stderr)
            return 1
    notes = outdir / f"llmgw-{__version__}.notes.md"
    notes.write_text(text)
    for path in sorted(outdir.glob(f"llmgw-{__version__}*")):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
