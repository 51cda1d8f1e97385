from tinylm.data.cleaning import CleanOptions, clean_documents, clean_text


def test_each_step_and_counts():
    opts = CleanOptions(
        fix_unicode=True,
        lowercase=True,
        standardize_punctuation=True,
        remove_urls=True,
        remove_emails=True,
        remove_html=True,
        min_chars=5,
        max_chars=60,
    )
    docs = [
        "The cafÃ© said \u201cHello\u201d \u2014 see https://x.org or mail a.b@c.com <b>now</b>",
        "Same  text",
        "same text",  # duplicate after lowercasing and whitespace normalisation
        "tiny",
        "x" * 100,
        "   ",
    ]
    out, report = clean_documents(docs, opts)
    assert out == ['the café said "hello" - see or mail now', "same text"]
    assert report.documents_in == 6 and report.documents_out == 2
    assert report.dropped == {"empty": 1, "too_short": 1, "too_long": 1, "duplicate": 1}
    assert report.changed["fix_unicode"] == 1 and report.changed["remove_urls"] == 1
    assert "dropped: empty 1" in report.summary()


def test_flags_off_leave_text_alone():
    opts = CleanOptions(fix_unicode=False, normalize_whitespace=False, deduplicate=False)
    text = "Keep  \u201cthis\u201d\n\n\n\nas is "
    assert clean_text(text, opts) == text
    out, _ = clean_documents([text, text], opts)
    assert len(out) == 2


def test_whitespace_normalisation_keeps_paragraphs():
    assert clean_text("a \t b  \r\n\n\n\nc ", CleanOptions(fix_unicode=False)) == "a b\n\nc"


def test_the_fourth_reports_steps_each_do_what_they_say_and_are_counted():
    opts = CleanOptions(fix_unicode=False, remove_repeats=True, letters_and_punctuation_only=True, collapse_dots=True)
    docs = [
        "She was very very very happy. Once upon a time, once upon a time there was a cat.",
        "Wait\u2026 then... ok . . . fine",
        "Tom \u2764\ufe0f his #1 dog \u00e9t\u00e9 [big] (yes)!",
        "Nothing to change here.",
    ]
    out, report = clean_documents(docs, opts)
    assert out[0] == "She was very happy. Once upon a time there was a cat."  # a repeated word, a repeated phrase
    assert out[1] == "Wait. then. ok. fine"
    assert out[2] == "Tom his 1 dog t big (yes)!"  # emoji, "#", accented letters and square brackets go
    assert out[3] == docs[3]
    assert report.changed == {
        "remove_repeats": 1,
        "collapse_dots": 1,
        "letters_and_punctuation_only": 1,
        "normalize_whitespace": 1,
    }
    assert clean_text("I had had enough", CleanOptions(remove_repeats=True)) == "I had enough"  # as the report did
