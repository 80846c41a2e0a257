"""``unbubble export RUN_DIR OUT``: a run's stage checkpoints merged into one model in its own names."""

from __future__ import annotations

import click


@click.command(context_settings={"show_default": True})
@click.argument("run_dir", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--step", type=int, default=None, help="Checkpoint step to export [default: the newest complete one].")
@click.option("--force", is_flag=True, default=False,
              help="Write into a non-empty OUT folder or over an existing OUT file, saying what was replaced "
                   "(never into a run folder).")
def export(run_dir: str, out: str, step: int | None, force: bool) -> None:
    """Merge RUN_DIR's stage checkpoints into one model at OUT.

    RUN_DIR is a run folder (its checkpoints/) or a checkpoint folder. A split Hugging Face model's
    run gives a folder from_pretrained loads (config.json + model.safetensors); any other run, or
    OUT ending in .pt, a torch.save'd state_dict that model.load_state_dict accepts. The weights
    are those a resume would start from (the fp32 masters of a --precision bf16 run); a run trained
    with --untie, or any preset run on more than one stage, exports untied: in Python,
    unbubble.export.load(OUT) builds the matching whole model and loads it, and
    unbubble.export.sample(model, "prompt") writes text with it. OUT may not be inside a run folder;
    an existing non-empty folder or file is refused unless --force.
    """
    from unbubble.export import export as write

    path = write(run_dir, out, step, force)
    click.echo(str(path))
