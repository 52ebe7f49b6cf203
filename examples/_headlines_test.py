"""The docs' number check on made-up text: what counts as marked, and what is not a number."""

from __future__ import annotations

import _headlines

EXPORTS = {("01", "short_token_weight"): "1/20", ("03", "local_over_big_0"): "27.5"}


def value_of(marker: _headlines.Marker) -> str | None:
    return EXPORTS.get((marker.source, marker.name))


def unmarked(text: str) -> list[str]:
    return [number for _, number, _ in _headlines.unmarked_numbers(text, value_of)]


def test_a_marker_names_its_source_and_covers_the_whole_number_before_it():
    (m,) = _headlines.markers("a token weighs **1/20<!-- 01:short_token_weight -->**")
    assert (m.line, m.source, m.name) == (1, "01", "short_token_weight")
    assert m.quotes("1/20") and not m.quotes("20")  # "20" is only the end of a number
    (m,) = _headlines.markers("weighs 11/20<!-- 01:short_token_weight -->")
    assert not m.quotes("1/20")
    (m,) = _headlines.markers("a loss of -0.0029<!-- 08:grpo_R1_k1 -->")
    assert m.quotes("-0.0029") and not m.quotes("0.0029")  # the sign is part of it


def test_marked_numbers_are_covered_and_unmarked_ones_are_found():
    assert (
        unmarked("weighs 1/20<!-- 01:short_token_weight --> (27.5<!-- 03:local_over_big_0 -->x)")
        == []
    )
    assert unmarked("weighs 1/20 (27.5x), 0.99% of it, 3.92x") == ["1/20", "27.5", "0.99", "3.92"]
    # a marker whose export is another number covers nothing
    assert unmarked("weighs 1/40<!-- 01:short_token_weight -->") == ["1/40"]
    assert unmarked("weighs 2.6e-06<!-- 01:nothing -->") == ["2.6e-06"]


def test_what_is_not_a_quoted_number():
    text = "\n".join(
        [
            "## 3. The missing 1/k",
            "",
            "1. a list item; see section 5, lessons 3 and 8, TRL issue 2175",
            "[3](#3-the-missing-1k) and [01](../examples/01_mean_of_means.py), [lesson 1](x.py)",
            "`grad_norm` 2 in `code 42`, with k = 4 on R=1 and 4 devices, 2 processes",
            "jax 0.10.2, Python 3.11, on 2026-11-30, in 01_mean_of_means.py: ZeRO-1, fp16, 2-D",
            "about 2<!-- time: make demo, minutes --> minutes",
            "",
            "    indented code 17",
            "",
            "```",
            "fenced 23",
            "```",
        ]
    )
    assert unmarked(text) == ["2"]  # `grad_norm` 2: the number after inline code is prose


def test_a_generated_block_is_its_generators_to_check():
    text = "\n".join(
        [
            "prose 7",
            "<!-- trl-table: begin (make trl-audit) -->",
            "| grpo | 1 | 4.4e-01 |",
            "<!-- trl-table: end -->",
            "after 9",
        ]
    )
    assert unmarked(text) == ["7", "9"]


def test_output_blocks():
    text = "<!-- output: 09 -->\n```\nline one\n...\nline two  \n```\n"
    assert _headlines.output_blocks(text) == [("09", ["line one", "line two"])]
