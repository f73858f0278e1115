def test_generated_code_is_current():
    from protos.gen import stale_files

    assert stale_files() == [], "run: python -m protos.gen"
