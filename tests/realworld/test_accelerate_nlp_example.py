"""accelerate's nlp_example.py (huggingface/accelerate, examples/nlp_example.py) ported piece by piece:
accelerate keeps its Accelerator, prepare, backward and save_state; torchplace reads its save_state
folder and the model's save_pretrained folder back into a fresh model. A one-layer BERT on random
token pairs, on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplace as tp


def test_accelerate_training_checkpoints_load_with_torchplace(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32, num_labels=2)
    accelerator = Accelerator(cpu=True)
    try:
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
        data = TensorDataset(torch.randint(0, 64, (16, 12)), torch.ones(16, 12, dtype=torch.long),
                             torch.randint(0, 2, (16,)))
        loader = DataLoader(data, batch_size=4, shuffle=True)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        model.train()
        for input_ids, attention_mask, labels in loader:
            outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
            accelerator.backward(outputs.loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        accelerator.save_state(tmp_path / "state")
        accelerator.unwrap_model(model).save_pretrained(tmp_path / "hf")
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    trained = accelerator.unwrap_model(model).state_dict()
    for folder, tool in ((tmp_path / "state", "accelerate"), (tmp_path / "hf", "transformers (save_pretrained)")):
        fresh = transformers.BertForSequenceClassification(config)
        opt = torch.optim.AdamW(fresh.parameters())
        ck = tp.load(folder, model=fresh, optimizer=opt if tool == "accelerate" else None)
        assert ck.tool == tool
        assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in trained.items())
        if tool == "accelerate":
            assert opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
