"""Evaluation tasks that reward context reuse, derived from the Python standard library.

Each task yields :class:`TaskExample` (prompt text, reference text, metric name) from
the held-out (``test``) stdlib files, deterministically:

* ``code_completion`` — the prompt is a file's opening ``context_chars`` (cut at a line
  end); the reference is the next ``reference_chars``. Metric: Edit Sim.
* ``docstring_qa`` — extractive QA: a function's source followed by
  ``# Q: what does <name> do?\\n# A:``; the reference is its docstring's first
  sentence, which the prompt contains. Metric: token F1.
* ``docstring_summary`` — a function's body without its docstring, then
  ``# Summary:``; the reference is the docstring's first line. Metric: ROUGE-L.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from speclab.data.corpus import split_files

TASKS = ("code_completion", "docstring_qa", "docstring_summary")


@dataclass(frozen=True)
class TaskExample:
    """One prompt with the text a good continuation should reproduce."""

    task: str
    prompt: str
    reference: str
    metric: str  # "edit_sim", "f1" or "rouge_l"


def load_task(task: str, num: int, context_chars: int = 1500,
              reference_chars: int = 200) -> list[TaskExample]:
    """Up to ``num`` examples of ``task`` from the held-out stdlib files."""
    if task not in TASKS:
        raise ValueError(f"task: must be one of {TASKS}, got {task!r}")
    if num < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {num}")
    out: list[TaskExample] = []
    for path in split_files("test"):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if task == "code_completion":
            out += _completion(text, context_chars, reference_chars)
        else:
            out += _docstring_examples(task, text, context_chars)
        if len(out) >= num:
            return out[:num]
    if not out:
        raise ValueError(f"task {task!r}: no examples found in the stdlib test files")
    return out


def _completion(text: str, context_chars: int, reference_chars: int) -> list[TaskExample]:
    if len(text) < context_chars + reference_chars:
        return []
    cut = text.rfind("\n", 0, context_chars) + 1 or context_chars
    return [TaskExample("code_completion", text[:cut], text[cut:cut + reference_chars],
                        "edit_sim")]


def _docstring_examples(task: str, text: str, max_chars: int) -> list[TaskExample]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40:
            continue
        src = "".join(lines[node.lineno - 1: node.end_lineno])
        if len(src) > max_chars:
            continue
        first_line = doc.strip().splitlines()[0].strip()
        if task == "docstring_qa":
            sentence = doc.strip().split(". ")[0].replace("\n", " ").strip()
            prompt = f"{src}\n# Q: what does {node.name} do?\n# A:"
            out.append(TaskExample(task, prompt, " " + sentence, "f1"))
        else:
            body = node.body[1:] if len(node.body) > 1 else node.body
            start = body[0].lineno - 1
            head = "".join(lines[node.lineno - 1: node.lineno])
            rest = "".join(lines[start: node.end_lineno])
            out.append(TaskExample(task, f"{head}{rest}\n# Summary:", " " + first_line,
                                   "rouge_l"))
    return out
