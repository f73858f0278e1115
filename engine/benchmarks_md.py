"""BENCHMARKS.md, as every benchmark script writes it: each owns one `## `
section and replaces it whole, ending its figures with the same provenance
lines (the command, when, and on what machine)."""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import sys
from pathlib import Path

BENCHMARKS_FILE = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


def machine() -> str:
    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = f", load average {os.getloadavg()[0]:.1f} when it finished" if hasattr(os, "getloadavg") else ""
    return (f"`nproc` {os.cpu_count()}, {cpu}, torch {torch.__version__} "
            f"({torch.get_num_threads()} intra-op threads), Python {platform.python_version()}{load}")


def cpu_isa_text() -> str:
    from engine.kernels import cpu_isas

    return ", ".join(cpu_isas()) or "none of the native kernel ISAs"


def provenance(command: str | None = None) -> str:
    """The lines every benchmark section ends its figures with: the command
    that produced them (when given), when, and on what machine."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"- Command: `{command.strip()}`"] if command else []
    return "\n".join(lines + [f"- Date: {now}", f"- Machine: {machine()}"])


def command_line(module: str, argv: list[str] | None) -> str:
    """How `python -m module` was run: its arguments (`argv`, else this process's), quoted."""
    return f"python -m {module} " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))


def side_by_side_parser(module: str, doc: str, section: str, single_stream: bool = True):
    """The parser of a benchmark that runs its variants side by side in one process: the kernel
    ISA paths and thread counts to run (comma-separated; comma_list), interleaved rounds, --write
    and --section (the BENCHMARKS.md heading it writes under, `section` unless another is named,
    as for another CPU's figures) and, for single-stream decode, the prompt and new tokens."""
    from engine.kernels import cpu_isas

    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    p.add_argument("--isa", default=",".join(cpu_isas()), help="kernel ISA paths, comma-separated")
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    if single_stream:
        p.add_argument("--prompt-len", type=int, default=128)
        p.add_argument("--new-tokens", type=int, default=128)
    add_output_arguments(p, section)
    return p


def add_output_arguments(p: argparse.ArgumentParser, section: str) -> None:
    """--write, and --section: the BENCHMARKS.md heading a script writes under (`section` unless another
    is named, as for another CPU's figures)."""
    p.add_argument("--write", action="store_true", help="replace the section --section of BENCHMARKS.md")
    p.add_argument("--section", type=_heading, default=section,
                   help=f"the heading to write under (default {section!r})")


def _heading(text: str) -> str:
    """An argparse type: a BENCHMARKS.md heading (`## ...`), for a script's --section."""
    if not text.startswith("## "):
        raise argparse.ArgumentTypeError(f"{text!r}: a BENCHMARKS.md section heading starts with '## '")
    return text


def comma_list(text: str, fn=str) -> list:
    """'1,2' -> [fn('1'), fn('2')], empty items dropped."""
    return [fn(s) for s in text.split(",") if s]


def publish(section: str, write: bool) -> int:
    """Print a benchmark's section and, when asked to (--write), put it into BENCHMARKS.md; 0,
    the script's exit status."""
    print(section)
    if write:
        write_section(section)
    return 0


def write_section(new_section: str, path: Path = BENCHMARKS_FILE) -> None:
    """Replace (or add) `new_section` in BENCHMARKS.md; see replace_section."""
    old = path.read_text() if path.is_file() else ""
    path.write_text(replace_section(old, new_section))


def replace_section(text: str, new_section: str) -> str:
    """`text` with the section named by `new_section`'s first line (a `## `
    heading; up to the next `## ` heading) replaced by it, or with it appended.
    Every benchmark script writes its own section of BENCHMARKS.md this way."""
    new_section = new_section.rstrip("\n") + "\n"
    heading = new_section.split("\n", 1)[0].strip()
    m = re.search(rf"^{re.escape(heading)}[ \t]*$", text, flags=re.M)
    if m is None:
        if not text.strip():
            return "# Benchmarks\n\n" + new_section
        return text.rstrip("\n") + "\n\n" + new_section
    nxt = re.search(r"^## ", text[m.end():], flags=re.M)
    end = m.end() + nxt.start() if nxt else len(text)
    rest = text[end:]
    return text[:m.start()] + new_section + ("\n" + rest if rest else "")
