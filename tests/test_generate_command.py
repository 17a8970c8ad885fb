"""`pagedserve generate` with an output constraint: --json-schema FILE, --regex, --choice."""

from __future__ import annotations

import json
import re

import pytest

from pagedserve.generate import main

SCHEMA = {"type": "object", "required": ["city", "sunny"],
          "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}}}


def completion_text(output: str) -> str:
    """The text between the prompt line and the [N tokens, ...] line."""
    return output.split("\n", 1)[1].rsplit("\n[", 1)[0]


def test_json_schema_file(smollm2_path, tmp_path, capsys):
    schema_file = tmp_path / "weather.json"
    schema_file.write_text(json.dumps(SCHEMA))
    assert main(["--model", str(smollm2_path), "--chat", "--prompt", "Weather in Rome?",
                 "--max-tokens", "60", "--json-schema", str(schema_file),
                 "--max-model-len", "512"]) == 0
    output = capsys.readouterr().out
    assert "finish_reason=stop" in output, output
    value = json.loads(completion_text(output))
    assert set(value) == {"city", "sunny"} and isinstance(value["sunny"], bool)


def test_regex_and_a_bad_schema(smollm2_path, tmp_path, capsys):
    assert main(["--model", str(smollm2_path), "--prompt", "Call me at",
                 "--regex", r"[0-9]{3}-[0-9]{4}", "--max-model-len", "512"]) == 0
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", completion_text(capsys.readouterr().out))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}}))
    with pytest.raises(SystemExit, match="structured_outputs.json is invalid"):
        main(["--model", str(smollm2_path), "--json-schema", str(bad), "--max-model-len", "512"])
