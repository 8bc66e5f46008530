"""The types of /datasets (app/api/routes/datasets.py): a dataset's description (its meta.json, with the card of
a dataset imported from the Hub), an import from the Hub (which answers a job: jobs.py's JobStatus) and the
OpenAPI description of POST /datasets' two bodies."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, BaseModel, Field

from app.schemas.models import Revision
from app.schemas.shared import STRICT, Name, invalid
from datadir import NAME_PATTERN
from datadir.datasets import DATASET_KINDS, LISTED_LABELS
from datadir.jobs import LEGACY_OWNER
from model.data.hub_layout import parse_split
from model.data.hub_rows import importable_kinds
from model.errors import UserError
from model.sources import HUB_ID_PATTERN

ImportableKind = Literal["labelled", "token-labelled", "qa", "pairs", "scored-pairs", "corpus"]
assert set(get_args(ImportableKind)) == set(importable_kinds())


def _check_split(value: str) -> str:
    try:
        parse_split(value)
    except UserError as e:
        raise invalid(str(e)) from None
    return value


ColumnName = Annotated[str, Field(min_length=1, max_length=200)]


class ImportDatasetRequest(BaseModel):
    """POST /datasets as JSON: one split of a Hugging Face Hub dataset repo (a file is sent as multipart instead)."""

    model_config = STRICT

    name: Name = Field(description="The dataset's name in DATA_DIR/datasets/ (a name is never reused).")
    source: str = Field(
        pattern=HUB_ID_PATTERN,
        max_length=200,
        description="A Hugging Face Hub dataset repo id, e.g. stanfordnlp/imdb (never a path on the server).",
    )
    revision: Revision | None = Field(None, description="A branch, tag or commit; default main.")
    subset: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="The subset (the card's config_name); default: the card's default, or the only one.",
    )
    split: Annotated[str, AfterValidator(_check_split)] | None = Field(
        None,
        max_length=200,
        description="The split, optionally with a slice of rows (train[:10000]); default: the only one. Several "
        "splits and none named is a 422 that lists them (and the subsets).",
        examples=["train", "train[:10000]"],
    )
    columns: dict[ColumnName, ColumnName] | None = Field(
        None,
        max_length=100,
        description="Columns renamed to a kind's before anything is read, {source: column}: "
        '{"query": "anchor", "answer": "positive"}.',
    )
    kind: ImportableKind | None = Field(
        None, description="What the split holds; default: what its columns name (as an upload's header does)."
    )


IMPORT_DATASET_EXAMPLE = {"name": "imdb", "source": "stanfordnlp/imdb", "split": "train"}

# POST /datasets is parsed by the route (JSON: an import) or by app/jobs/uploads.py as it streams in (multipart:
# an upload), so FastAPI never sees a body model; this is its OpenAPI description.
DATASET_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": ImportDatasetRequest.model_json_schema(),
                "examples": {"hub": {"value": IMPORT_DATASET_EXAMPLE}},
            },
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
                            "'tags' (IOB2); qa: SQuAD v1.1/v2.0 .json; pairs: .csv, .tsv or .jsonl with "
                            "'anchor', 'positive' and optionally 'negative' or 'negative_1'..'negative_n'; "
                            "scored-pairs: .csv, .tsv or .jsonl with 'sentence1', 'sentence2' and 'score' (0..1); "
                            "retrieval (evaluation only): a .zip, .tar.gz, .tgz or .tar of a BEIR folder "
                            "(corpus.jsonl, queries.jsonl, qrels.tsv or qrels/<split>.tsv), or one .jsonl of "
                            "documents {'_id', 'text'} and queries {'query', 'positive_ids'}",
                        },
                        "name": {
                            "type": "string",
                            "pattern": NAME_PATTERN,
                            "description": "Default: the file name without its suffix.",
                        },
                        "kind": {
                            "type": "string",
                            "enum": list(DATASET_KINDS),
                            "description": "Default: from the extension and the columns (a .jsonl's first "
                            "record): .csv and .tsv are pairs with 'anchor' and 'positive', scored-pairs with "
                            "'sentence1', 'sentence2' and 'score', else labelled; .jsonl is also "
                            "token-labelled with 'tokens' and 'tags', retrieval with 'query' and "
                            "'positive_ids', else corpus; .txt is corpus; an archive is retrieval.",
                        },
                    },
                }
            },
        },
    }
}

DatasetKind = Literal["corpus", "labelled", "token-labelled", "qa", "pairs", "scored-pairs", "retrieval"]
assert set(get_args(DatasetKind)) == set(DATASET_KINDS)


class DatasetSource(BaseModel):
    """The card of a dataset imported from the Hugging Face Hub."""

    kind: Literal["hub"] = "hub"
    repo: str
    revision: str = Field(description="As asked (main by default; refs/convert/parquet for a loading script's repo).")
    sha: str = Field(description="The commit the files came from.")
    subset: str
    split: str = Field(description="As asked, with its slice of rows if any: train, train[:10000].")
    license: str | None = Field(None, description="The card's license, if it names one.")
    rows: int = Field(description="Rows read from the split (a tagged sentence, a question, a pair each).")
    columns: dict[str, str] | None = Field(None, description="The split's columns that were renamed: {source: column}.")
    files: list[str] = Field(description="The split's files in the repo.")


class DatasetInfo(BaseModel):
    name: str
    kind: DatasetKind
    format: str
    file: str = Field(description="The data file in the dataset's folder; `data`, a folder, for a retrieval archive.")
    original_filename: str = Field(description="The file uploaded; an import's files in the repo.")
    bytes: int = Field(description="The size of the file as uploaded (an import: as written).")
    sha256: str
    created_at: str
    owner: str = Field(
        LEGACY_OWNER,
        description="The name of the key that uploaded it (`admin` for datasets from before keys had names).",
    )
    shared: bool = Field(
        True, description="Every key may train on it: an admin uploaded it. Else only its owner (and admins) see it."
    )
    documents: int | None = Field(None, description="A corpus's documents; a retrieval set's corpus documents.")
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
    negatives: int | None = Field(None, description="Pairs: the hard negatives of each row.")
    ids: bool | None = Field(None, description="Pairs: whether rows carry an `id`.")
    distinct_anchors: int | None = None
    mean_chars: dict[str, float] | None = Field(
        None, description="Pairs and scored pairs: the mean characters of each text column (`negative`: all negatives)."
    )
    mean_score: float | None = None
    queries: int | None = Field(None, description="Retrieval: the queries its split judges.")
    judgements: int | None = Field(None, description="Retrieval: the relevant (query, document) pairs of its split.")
    split: str | None = Field(None, description="Retrieval: the split evaluated unless a job names one.")
    splits: list[str] | None = Field(None, description="Retrieval: every judged split (each checked at upload).")
    disk_bytes: int | None = Field(None, description="Bytes on disk: the file, meta.json and token caches.")
    source: DatasetSource | None = Field(None, description="Imported from the Hugging Face Hub: where from.")


class DatasetsResponse(BaseModel):
    datasets: list[DatasetInfo]
