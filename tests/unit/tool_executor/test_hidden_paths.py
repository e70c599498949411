from services.tool_executor.zygote import plan_hidden


def test_hidden_dirs_keep_the_interpreter_reachable(tmp_path):
    (tmp_path / "home" / "me" / ".pyenv" / "py311" / "lib").mkdir(parents=True)
    (tmp_path / "home" / "me" / "secrets").mkdir()
    (tmp_path / "repo" / ".venv").mkdir(parents=True)
    (tmp_path / "repo" / "services").mkdir()
    (tmp_path / "shadow").write_text("x")
    keep = [str(tmp_path / "home" / "me" / ".pyenv" / "py311"), str(tmp_path / "home" / "me" / ".pyenv" / "py311" / "bin"), str(tmp_path / "repo" / ".venv")]
    hidden = [str(tmp_path / "home"), str(tmp_path / "repo"), str(tmp_path / "repo" / "services"), str(tmp_path / "shadow"), str(tmp_path / "missing")]
    with_keeps, plain = plan_hidden(hidden, keep)
    assert dict(with_keeps) == {
        str(tmp_path / "home"): [str(tmp_path / "home" / "me" / ".pyenv" / "py311")],
        str(tmp_path / "repo"): [str(tmp_path / "repo" / ".venv")],
    }
    # repo/services is covered with repo; a missing path is skipped; a file is covered plainly.
    assert plain == [str(tmp_path / "shadow")]


def test_a_hidden_path_inside_a_kept_one_is_not_covered(tmp_path):
    (tmp_path / "venv" / "secret").mkdir(parents=True)
    with_keeps, plain = plan_hidden([str(tmp_path / "venv" / "secret")], [str(tmp_path / "venv")])
    assert with_keeps == [] and plain == []


def test_a_hidden_path_holding_the_private_tmp_is_not_covered():
    # A checkout in /tmp: its parent is /tmp itself, which the calls get as a private tmpfs.
    with_keeps, plain = plan_hidden(["/tmp", "/"], [])
    assert with_keeps == [] and plain == []
