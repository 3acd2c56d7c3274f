"""Train a tiny random GPT-2 with the Transformers Trainer and TelemetryCallback, then read it.

    python examples/transformers_training.py
    torchrun --nproc_per_node 2 examples/transformers_training.py --rank-policy all

A randomly initialised two-layer GPT-2 (no download) learns a synthetic next-token task on the
CPU in a few seconds: two micro-batches per optimizer step, telemetry of every 10th optimizer
step routed into the Trainer's TensorBoard at ``state.global_step``, beside ``train/loss``. Ends
by printing where the files are, how to open TensorBoard, and a per-layer table of the run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from torchinstruments_core.run_directory import summarize_run
from torchinstruments_transformers import TelemetryCallback


def synthetic_data(samples: int = 512, length: int = 16) -> list[dict[str, torch.Tensor]]:
    """Sequences that count up modulo the vocabulary from a random start: learnable at once."""
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 64, (samples, 1), generator=generator)
    ids = (starts + torch.arange(length)) % 64
    return [{"input_ids": row, "labels": row} for row in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=Path("runs/transformers_training"))
    parser.add_argument("--every-n-steps", type=int, default=10)
    parser.add_argument("--rank-policy", choices=["rank0", "all"], default="rank0")
    parser.add_argument("--max-steps", type=int, default=60)
    args = parser.parse_args()

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64, n_positions=32)
    config.bos_token_id = config.eos_token_id = 0
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=str(args.output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        logging_steps=5,
        report_to=["tensorboard"],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    telemetry = TelemetryCallback(every_n_steps=args.every_n_steps, rank_policy=args.rank_policy)
    trainer = Trainer(
        model=model, args=training, train_dataset=synthetic_data(), callbacks=[telemetry]
    )
    trainer.train()

    if trainer.is_world_process_zero() and telemetry.run_directory is not None:
        folder = telemetry.run_directory
        run = folder / "rank-000" if args.rank_policy == "all" else folder
        print(f"\n{trainer.state.global_step} optimizer steps; telemetry of every ", end="")
        print(f"{args.every_n_steps}th (global steps 1, {args.every_n_steps + 1} …) in")
        print(f"  {folder}/  (history.parquet, samples.parquet, result.json, index.md)")
        print(f"TensorBoard (loss and telemetry): tensorboard --logdir {args.output_dir}/runs\n")
        print(summarize_run(run))


if __name__ == "__main__":
    main()
