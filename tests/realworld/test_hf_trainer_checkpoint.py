"""transformers' Trainer checkpoints (huggingface/transformers, src/transformers/trainer.py: _save_checkpoint
writes output_dir/checkpoint-N with model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth,
trainer_state.json, training_args.bin), continued by a plain loop that resumes with torchplace.load as its docs
say. A tiny BERT from a config, 4 steps on the CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import torchplace as tp

transformers = pytest.importorskip("transformers")


def tiny_bert() -> torch.nn.Module:
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2)
    return transformers.BertForSequenceClassification(cfg)


def test_a_trainer_checkpoint_folder_resumes_model_optimizer_and_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tiny_bert()
    data = [{"input_ids": torch.randint(0, 50, (8,)), "labels": torch.tensor(i % 2)} for i in range(32)]
    args = transformers.TrainingArguments(str(tmp_path / "out"), max_steps=4, save_steps=2, report_to=[],
                                          per_device_train_batch_size=8, use_cpu=True, disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    folder = tmp_path / "out" / "checkpoint-4"
    assert {"optimizer.pt", "scheduler.pt", "trainer_state.json"} <= set(os.listdir(folder))

    again = tiny_bert()
    opt = transformers.Trainer(model=again, args=args).create_optimizer()  # the Trainer's two groups
    ck = tp.load(folder, device="cpu", model=again, optimizer=opt)
    assert ck.tool == "transformers (Trainer checkpoint)"
    assert ck.extra["trainer_state"]["global_step"] == 4
    assert any("rng_state.pth left out" in n for n in ck.notes)  # numpy's state needs pickle
    saved = torch.load(folder / "optimizer.pt")
    assert opt.state_dict()["state"][0]["step"] == saved["state"][0]["step"] == 4
    assert torch.equal(again.classifier.weight, model.classifier.weight)

    plain = torch.optim.AdamW(tiny_bert().parameters())  # one group: refused, nothing changed
    with pytest.raises(tp.CheckpointError, match=r"(?s)2 saved, 1 in the optimizer.*left as they were"):
        tp.load(folder, device="cpu", model=tiny_bert(), optimizer=plain)
    with pytest.raises(tp.CheckpointError, match=r"(?s)checkpoint-2.*load it by its name"):
        tp.load(tmp_path / "out", model=again)  # the output folder: name the checkpoint-N
