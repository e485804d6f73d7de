"""Parsers of the tool-call syntax models are trained to write, for tool_choice "auto"
(`tessera serve --tool-call-parser NAME`). Each turns a finished output into its content
and its calls, says how much of a partial output is surely content, so that a stream
can send it as it comes and hold back what may become a call, and (the JSON ones) which
calls a partial output has begun: each name once whole, its arguments object as written
so far, which a stream sends as it grows. A finished call's arguments object is that same
text, as the model wrote it.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen 2.5/3,
  Hermes and many fine-tunes); text before the first block is content; a last block may
  lack its closing tag.
- `llama3_json`: an output that is a JSON object `{"name": ..., "parameters": {...}}` (or
  several separated by `;`), optionally after `<|python_tag|>` (Llama 3.1-3.3's templates);
  an output that starts otherwise is content.
- `mistral`: `[TOOL_CALLS]` and a JSON list of calls, or `name[ARGS]{...}` per call (newer
  Mistral tokenizers); text before it is content.
- `pythonic`: an output that is a Python list of calls, `[f(x=1), g(y="a")]` (Llama 3.2
  and 4), parsed with `ast` (literal values only; nothing is evaluated).
- `openai`: gpt-oss's harmony calls, as `--reasoning-parser openai_gptoss` writes them into
  the content (harmony.py): `<|start|>assistant to=NAME<|message|>{...}<|call|>`.
- `deepseek_v3` (also `deepseek_v31`): DeepSeek's `<｜tool▁calls▁begin｜>` blocks, each call
  `function<｜tool▁sep｜>NAME` and its arguments in a json fence (V3, R1) or
  `NAME<｜tool▁sep｜>{...}` (V3.1 on); text before them is content.
- `qwen3_coder` (also `qwen3_xml`): Qwen3-Coder's and Qwen3.5's `<tool_call><function=NAME>
  <parameter=KEY>value</parameter></function></tool_call>`, values typed by the request's
  tool schemas (xml_calls.py).
- `gemma4`: Gemma 4's `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>` blocks, in
  its own notation (gemma4_calls.py); calls are sent once whole.
A malformed call leaves the whole output as content.
"""

from tessera.server.tool_parsers.base import Call, Parsed, PartialCall, ToolCallParser, json_text, loads
from tessera.server.tool_parsers.gemma4_calls import Gemma4CallParser
from tessera.server.tool_parsers.json_calls import HermesParser, Llama3JsonParser, MistralParser
from tessera.server.tool_parsers.marker_calls import DeepSeekCallParser, HarmonyCallParser
from tessera.server.tool_parsers.pythonic import PythonicParser
from tessera.server.tool_parsers.xml_calls import Qwen3XmlParser

PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser(),
                                      "mistral": MistralParser(), "pythonic": PythonicParser(),
                                      "openai": HarmonyCallParser(), "deepseek_v3": DeepSeekCallParser(),
                                      "deepseek_v31": DeepSeekCallParser(), "qwen3_coder": Qwen3XmlParser(),
                                      "qwen3_xml": Qwen3XmlParser(), "gemma4": Gemma4CallParser()}

__all__ = ["PARSERS", "Call", "Parsed", "PartialCall", "ToolCallParser", "json_text", "loads"]
