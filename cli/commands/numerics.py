"""`minigpt numerics`: what each number format can hold, and four experiments that show it."""

from __future__ import annotations

import json

import click

from cli.output import print_table


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def numerics(as_json: bool) -> None:
    """Facts of fp32, fp16, bf16 and fp8 (computed from torch's dtypes), and experiments:
    (a) underflow and loss scaling, (b) small additions swallowed, (c) overflow,
    (d) pure fp16 weights stall where fp32 master weights learn."""
    from precision.experiments import experiment_master_weights
    from precision.formats import all_format_facts, experiment_overflow, experiment_swamping, experiment_underflow

    formats = [facts.as_dict() for facts in all_format_facts()]
    experiments = {
        "a_underflow": experiment_underflow(),
        "b_swamping": experiment_swamping(),
        "c_overflow": experiment_overflow(),
        "d_master_weights": experiment_master_weights(),
    }
    if as_json:
        click.echo(json.dumps({"formats": formats, "experiments": experiments}))
        return
    print_table(
        ["format", "bits", "exp", "mant", "max", "smallest normal", "smallest subnormal", "eps", "bytes"],
        [
            [
                f["name"],
                f["total_bits"],
                f["exponent_bits"],
                f["mantissa_bits"],
                f"{f['max']:.6g}",
                f"{f['smallest_normal']:.3g}",
                f"{f['smallest_subnormal']:.3g}",
                f"{f['eps']:.3g}",
                f["bytes"],
            ]
            for f in formats
        ],
    )
    click.echo("")
    for name, result in experiments.items():
        click.echo(f"({name[0]}) {result['finding']}")
