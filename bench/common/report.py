"""What every benchmark reports with: one table printer, one percentile rule, JSON.

    print_table(["run", "seconds", "out tok/s"], rows, title="shared prefix")
    percentile(latencies, 99)         # numpy's linear interpolation, as vLLM's bench
    write_json(path, report)

Cells are formatted by the caller (it knows the units); the table only aligns
them: the first `left` columns to the left, the numbers after them to the right.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table


def percentile(values: Iterable[float], p: float) -> float:
    """The p-th percentile (0..100), interpolating linearly between the closest
    ranks: numpy's default, which `vllm bench serve` uses too. 0.0 when empty."""
    values = list(values)
    return float(np.percentile(values, p)) if values else 0.0


def print_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[object]],
    title: str | None = None,
    left: int = 1,
) -> None:
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, title_justify="left")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i < left else "right", no_wrap=True)
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    console = Console()
    if not console.is_terminal:
        # Piped output gets 80 columns from rich, and a wide table would be
        # squeezed into them; logs and files have no right edge.
        wide = console.options.update(max_width=1 << 16)
        console = Console(width=max(Measurement.get(console, wide, table).maximum, 80))
    console.print(table)


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
