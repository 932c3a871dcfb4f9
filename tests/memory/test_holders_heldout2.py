"""Memory growth from other projects' public reports (issue 31), written as a held-out set and scored once, on
2026-12-02 (session 10): 2 of 5 named as written (docs/results/heldout2-memory-cpu-2026-12-02-session10.txt). Now a
development set like test_holders_heldout.py. Each test reproduces its report's loop (cited in its docstring) on the
CPU, with tensors large enough that the growth clears the CPU's tolerance (16 MiB) well, and says what the tracker
must name: the holder as the user wrote it, or for memory kept only by an autograd graph, the tensor at the graph's
root. Checked with plain torch when written (no tracker: the process's resident memory, glibc's mmap threshold
pinned so that freed blocks go back): each loop grew 64-128 MiB over its 16 steps, the same loop with the report's
fix under 8 MiB."""

from __future__ import annotations

import weakref
from collections import deque
from pathlib import Path

import pytest
import torch
from torch import nn

from torchplace import track_memory
from torchplace.memory import MemoryLeakWarning


def line_of(text: str) -> str:
    """'FILE.py:N' of the first line of this file containing TEXT."""
    lines = Path(__file__).read_text().splitlines()
    return f"{Path(__file__).name}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


class MolGraph:
    """chemprop's featurized molecule, shortened: atom and bond features as tensors."""

    def __init__(self, smiles: str) -> None:
        self.smiles = smiles
        self.f_atoms = torch.randn(1024, 1024)
        self.f_bonds = torch.randn(1024, 1024)


SMILES_TO_GRAPH: dict[str, MolGraph] = {}


def mol2graph(smiles_batch: list[str], cache: bool = True) -> list[MolGraph]:
    mol_graphs = []
    for smiles in smiles_batch:
        if smiles in SMILES_TO_GRAPH:
            mol_graph = SMILES_TO_GRAPH[smiles]
        else:
            mol_graph = MolGraph(smiles)
            if cache:
                SMILES_TO_GRAPH[smiles] = mol_graph
        mol_graphs.append(mol_graph)
    return mol_graphs


def test_featurization_cache_global_dict_fills_during_inference():
    """chemprop/chemprop#32: inference on ever new molecules; `if cache: SMILES_TO_GRAPH[d.smiles] = mol_graph`
    keeps every featurized graph in a module-level dict ("filled my RAM")."""
    model = nn.Linear(1024, 1)
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for i in range(16):
                with torch.no_grad():
                    for mol_graph in mol2graph([f"C{'C' * i}O"]):
                        model(mol_graph.f_atoms).mean()
                tracker.step()
    grew = tracker.report.grew
    assert [(g.name, g.where) for g in grew][:1] == [("dict `SMILES_TO_GRAPH`",
                                                      line_of("SMILES_TO_GRAPH[smiles] = mol_graph"))]


class EvaluationLoop:
    """Lightning's evaluation loop (1.1), shortened: it caches what every validation step returned and resets the
    cache only when the next validation epoch starts."""

    def __init__(self) -> None:
        self.outputs: list = []

    def setup(self) -> None:
        self.outputs = []

    def evaluation_step(self, model: nn.Module, batch: torch.Tensor) -> dict:
        output = model.validation_step(batch)
        self.outputs.append(output)
        return output


class Trainer:
    def __init__(self) -> None:
        self.evaluation_loop = EvaluationLoop()


class BoringModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1024, 1024)

    def validation_step(self, batch: torch.Tensor) -> dict:
        output = self.layer(batch)
        return {"x": output}


def test_evaluation_loop_outputs_cached_until_the_next_validation_epoch():
    """Lightning-AI/pytorch-lightning#5735: `trainer.evalutaion_loop.outputs caches the outputs of every validation
    steps`, and is not reset until the start of the next validation epoch."""
    model, trainer = BoringModel(), Trainer()
    trainer.evaluation_loop.setup()
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for _ in range(16):
                with torch.no_grad():
                    trainer.evaluation_loop.evaluation_step(model, torch.randn(1024, 1024))
                tracker.step()
    grew = tracker.report.grew
    assert [(g.name, g.where) for g in grew][:1] == [("list `trainer.evaluation_loop.outputs`",
                                                      line_of("self.outputs.append(output)"))]


class BaseTrack:
    """FairMOT's BaseTrack: `features` is a class attribute, one list shared by every track."""

    _count = 0
    track_id = 0
    features: list = []  # as the report has it: the leak


class STrack(BaseTrack):
    """FairMOT's STrack (appearance features kept as torch tensors): __init__ calls update_features() before it
    makes the track's own deque, so the first feature of every detection goes to BaseTrack.features."""

    def __init__(self, tlwh: torch.Tensor, score: float, temp_feat: torch.Tensor, buffer_size: int = 30) -> None:
        self._tlwh = tlwh
        self.score = score
        self.smooth_feat = None
        self.update_features(temp_feat)
        self.features = deque([], maxlen=buffer_size)
        self.alpha = 0.9

    def update_features(self, feat: torch.Tensor) -> None:
        feat /= feat.norm()
        self.curr_feat = feat
        if self.smooth_feat is None:
            self.smooth_feat = feat
        else:
            self.smooth_feat = self.alpha * self.smooth_feat + (1 - self.alpha) * feat
        self.features.append(feat)
        self.smooth_feat /= self.smooth_feat.norm()


def test_track_features_appended_to_a_class_attribute():
    """ifzhang/FairMOT#348: `self.update_features(temp_feat)` comes before `self.features = deque([], maxlen=...)`,
    so every detection's feature is appended to the class attribute BaseTrack.features: memory grows each frame."""
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for _ in range(16):
                id_feature = torch.randn(512, 2048)
                detections = [STrack(torch.tensor([0.0, 0.0, 10.0, 20.0]), 0.9, id_feature[i])
                              for i in range(id_feature.shape[0])]
                del detections
                tracker.step()
    grew = tracker.report.grew
    assert [(g.name, g.where) for g in grew][:1] == [("list `BaseTrack.features`",
                                                      line_of("self.features.append(feat)"))]


class ModelPatcher:
    """A ComfyUI-style patched clone: it keeps a reference to the model it was cloned from."""

    def __init__(self, model: nn.Module, strength: float) -> None:
        self.model = model
        self.strength = strength


_LORA_MODEL_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def apply_director_lora(model: nn.Module, strength: float) -> ModelPatcher:
    patched = _LORA_MODEL_CACHE.get(model)
    if patched is None:
        patched = {"patched": ModelPatcher(model, strength)}
        _LORA_MODEL_CACHE[model] = patched
    return patched["patched"]


def test_weak_key_cache_whose_values_hold_their_keys():
    """WhatDreamsCost/WhatDreamsCost-ComfyUI#212: `_LORA_MODEL_CACHE` is a WeakKeyDictionary whose values hold a
    strong reference back to the model used as the key, so no entry is ever evicted; the models are reloaded on each
    run, so each run leaves one more model set alive."""
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for _ in range(16):
                model = nn.Linear(2048, 1024)  # ComfyUI reloads the models from disk on every execution
                with torch.no_grad():
                    apply_director_lora(model, 0.5).model(torch.randn(8, 2048))
                del model
                tracker.step()
    names = [g.name for g in tracker.report.grew]
    assert names and "_LORA_MODEL_CACHE" in names[0], names


class Experience:
    """metta's experience buffer, shortened: preallocated CPU tensors that each rollout step writes into."""

    def __init__(self, num_steps: int, num_envs: int, hidden_size: int) -> None:
        self.lstm_h = torch.zeros(num_steps, 1, num_envs, hidden_size)
        self.lstm_c = torch.zeros(num_steps, 1, num_envs, hidden_size)

    def store(self, step: int, lstm_h: torch.Tensor, lstm_c: torch.Tensor) -> None:
        self.lstm_h[step] = lstm_h
        self.lstm_c[step] = lstm_c.detach()


def test_lstm_state_stored_in_the_experience_buffer_without_detach():
    """Metta-AI/metta#1139: "computational graphs with LSTM state were persisting into the experience replay buffer
    when they're supposed to be detached" (the rollout runs with grad on; its state is detached between steps, but
    the h written into the buffer is not)."""
    lstm = nn.LSTM(512, 512)
    experience = Experience(num_steps=16, num_envs=256, hidden_size=512)
    h, c = torch.zeros(1, 256, 512), torch.zeros(1, 256, 512)
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for step in range(16):
                obs = torch.randn(1, 256, 512)
                _, (h, c) = lstm(obs, (h.detach(), c.detach()))
                experience.store(step, h, c)  # the leak: experience.store(step, h.detach(), c.detach())
                tracker.step()
    grew = tracker.report.grew
    assert [(g.name, g.where) for g in grew][:1] == [("autograd graph of tensor `experience.lstm_h`",
                                                      line_of("self.lstm_h[step] = lstm_h"))]
