"""The types of /datasets (app/api/routes/datasets.py): a dataset's description (its meta.json) and the
OpenAPI description of the upload's multipart body."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, Field

from datadir import NAME_PATTERN
from datadir.datasets import DATASET_KINDS, LISTED_LABELS
from datadir.jobs import LEGACY_OWNER

# POST /datasets is parsed by app/jobs/uploads.py as it streams in, so FastAPI never sees a body model;
# this is its OpenAPI description.
DATASET_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": "corpus: .txt or .jsonl (a 'text' field); labelled: .csv, .tsv or .jsonl "
                            "with 'text' and 'label' (and optionally 'text_pair'); token-labelled: CoNLL "
                            "columns (.conll, .iob, .iob2, .bio, .txt, .tsv) or .jsonl with 'tokens' and "
                            "'tags' (IOB2); qa: SQuAD v1.1/v2.0 .json",
                        },
                        "name": {
                            "type": "string",
                            "pattern": NAME_PATTERN,
                            "description": "Default: the file name's stem.",
                        },
                        "kind": {
                            "type": "string",
                            "enum": list(DATASET_KINDS),
                            "description": "Default: from the extension, the first kind it can be (.txt: corpus; .tsv: "
                            "labelled; .jsonl: token-labelled if rows have 'tokens' and 'tags', labelled "
                            "if 'label', else corpus).",
                        },
                    },
                }
            }
        },
    }
}

DatasetKind = Literal["corpus", "labelled", "token-labelled", "qa"]
assert set(get_args(DatasetKind)) == set(DATASET_KINDS)


class DatasetInfo(BaseModel):
    name: str
    kind: DatasetKind
    format: str
    file: str
    original_filename: str
    bytes: int
    sha256: str
    created_at: str
    owner: str = Field(
        LEGACY_OWNER,
        description="The name of the key that uploaded it (`admin` for datasets from before keys had names).",
    )
    shared: bool = Field(
        True, description="Every key may train on it: an admin uploaded it. Else only its owner (and admins) see it."
    )
    documents: int | None = None
    sentences: int | None = None
    rows: int | None = None
    num_labels: int | None = Field(
        None,
        description=f"Distinct labels (tags); `labels` and the counts list at "
        f"most {LISTED_LABELS} of them, the most frequent.",
    )
    labels: list[str] | None = None
    label_counts: dict[str, int] | None = None
    is_pair: bool | None = None
    tokens: int | None = None
    entity_counts: dict[str, int] | None = None
    questions: int | None = None
    impossible: int | None = None
    contexts: int | None = None
    disk_bytes: int | None = Field(None, description="Bytes on disk: the file, meta.json and token caches.")


class DatasetsResponse(BaseModel):
    datasets: list[DatasetInfo]
