"""``unbubble schedules``: list the schedules with one line of semantics each."""

import click

from unbubble.schedules.registry import SCHEDULES


@click.command()
def schedules() -> None:
    """List the available pipeline schedules."""
    width = max(map(len, SCHEDULES))
    for name, line in SCHEDULES.items():
        click.echo(f"{name:<{width}}  {line}")
