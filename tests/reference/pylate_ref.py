"""PyLate's own answers for a ColBERT model directory, as JSON: run in a Python that has PyLate (tests set
BERT_PYLATE_PYTHON to it) by tests/model/test_late_interaction.py. Not part of the project: it imports
nothing of it.

stdin:  {"model": DIR, "queries": [...], "documents": [...], "pairs": {"anchor": [...], "positive": [...],
         "negative": [...], "teacher": [[...], ...]}, "temperature": T, "save": DIR or null}
stdout: {"queries": per query its token vectors, "documents": per document its token vectors,
         "scores": per query its MaxSim score with each document (each scored alone),
         "contrastive": the Contrastive loss on the pairs, "distillation": the Distillation loss on the
         anchors, their positive and negative as candidates, and the teacher's scores}
With "save", the model loaded from "model" is saved there by ColBERT.save (PyLate's own layout).
"""

import json
import sys

import torch
from pylate import losses, models, scores


def main() -> None:
    spec = json.load(sys.stdin)
    model = models.ColBERT(spec["model"], device="cpu")
    model.eval()
    q = model.encode(spec["queries"], is_query=True, convert_to_numpy=False, convert_to_tensor=False)
    d = model.encode(spec["documents"], is_query=False, convert_to_numpy=False, convert_to_tensor=False)
    q = [t.float() for t in q]
    d = [t.float() for t in d]
    out = {
        "queries": [t.tolist() for t in q],
        "documents": [t.tolist() for t in d],
        "scores": [[scores.colbert_scores(qi[None], di[None]).item() for di in d] for qi in q],
    }
    pairs = spec.get("pairs")
    if pairs:
        anchor = model.tokenize(pairs["anchor"], is_query=True, pad=True)
        positive = model.tokenize(pairs["positive"], is_query=False, pad=True)
        negative = model.tokenize(pairs["negative"], is_query=False, pad=True)
        with torch.no_grad():
            contrastive = losses.Contrastive(model, temperature=spec.get("temperature", 1.0))
            out["contrastive"] = contrastive([anchor, positive, negative]).item()
            candidates = [t for pair in zip(pairs["positive"], pairs["negative"]) for t in pair]
            documents = model.tokenize(candidates, is_query=False, pad=True)
            teacher = torch.tensor(pairs["teacher"], dtype=torch.float32)
            out["distillation"] = losses.Distillation(model)([anchor, documents], teacher).item()
    if spec.get("save"):
        model.save(spec["save"])
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
