"""`zerolm serve` (zerolm.serve): OpenAI's completions through the openai client, whole and streamed, equal to
`zerolm sample`; 32 clients at once get what each gets alone, decoded together; lm-evaluation-harness's
`local-completions` against the server gives `zerolm eval --tasks`'s numbers; the page in a real browser
streams what `zerolm sample` prints and says so when the server dies; stop sequences, the end of the
context, bad requests (4xx naming the field), a full queue (429), SIGTERM (answers in flight finish, exit 0)."""

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

from runs import REPO, env, train, zerolm

pytestmark = pytest.mark.slow  # a trained run and servers
CONTEXT = 256  # served past the trained 32 tokens: the model's positions are ALiBi's
ALLOWED = "http://allowed.example:3000"  # a site whose pages the shared server lets use it (--allow-origin)


@pytest.fixture(scope="module")
def alibi_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("served")
    train(run_dir, "model.position=alibi", "checkpoint.keep=1")
    return run_dir


class Server:
    """`zerolm serve` in a subprocess, on a free port."""

    def __init__(self, checkpoint, *flags):
        self.stderr = tempfile.NamedTemporaryFile("w+", suffix=".log")  # read while it runs
        self.proc = subprocess.Popen([sys.executable, "-m", "zerolm.cli", "serve", "--checkpoint", str(checkpoint),
                                      "--port", "0", *flags], env=env(1), cwd=REPO, text=True,
                                     stdout=subprocess.PIPE, stderr=self.stderr)
        line = self.proc.stdout.readline()
        match = re.match(r"serving (\S+) at (http://\S+)/ \(OpenAI API: (\S+);", line)
        assert match, (line, self.log())
        self.name, self.url, self.api = match.groups()

    def log(self) -> str:
        """What the server has written to its stderr."""
        return open(self.stderr.name).read()

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.api, api_key="none", max_retries=0, timeout=60)

    def rss_mb(self) -> float:
        status = open(f"/proc/{self.proc.pid}/status").read()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(alibi_run):
    s = Server(alibi_run / "ckpt", "--context", str(CONTEXT), "--max-tokens", "200", "--allow-origin", ALLOWED)
    yield s
    assert s.stop() == 0


def sample(run_dir, prompt, *flags):
    """What `zerolm sample` prints after the prompt."""
    out = zerolm("sample", "--checkpoint", run_dir / "ckpt", "--prompt", prompt, *flags, devices=1).stdout
    assert out.startswith(prompt)
    return out[len(prompt):].removesuffix("\n")


def test_the_openai_client_gets_what_zerolm_sample_prints_whole_and_streamed(alibi_run, server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [server.name]
    for flags, settings in [(["--temperature", "0"], dict(temperature=0)),
                            (["--temperature", "0.9", "--top-k", "40", "--seed", "3"],
                             dict(temperature=0.9, seed=3, extra_body={"top_k": 40})),
                            (["--temperature", "1.1", "--top-p", "0.9", "--typical-p", "0.95",
                              "--repetition-penalty", "1.3", "--seed", "5"],
                             dict(temperature=1.1, top_p=0.9, seed=5,
                                  extra_body={"typical_p": 0.95, "repetition_penalty": 1.3}))]:
        want = sample(alibi_run, "And God said", *flags, "--max-new-tokens", "40")
        whole = client.completions.create(model=server.name, prompt="And God said", max_tokens=40, **settings)
        assert whole.choices[0].text == want
        assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 40
        streamed = client.completions.create(model=server.name, prompt="And God said", max_tokens=40, stream=True,
                                             **settings)
        assert "".join(chunk.choices[0].text for chunk in streamed) == want


def test_a_stop_sequence_ends_the_text_before_it_whole_and_streamed(server):
    client = server.client()
    ask = dict(model=server.name, prompt="In the beginning", max_tokens=40, temperature=1.0, seed=2)
    text = client.completions.create(**ask).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3 and text.index(stop) > 0
    cut = text[:text.index(stop)]
    whole = client.completions.create(**ask, stop=[stop, "never in the text"])
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (cut, "stop")
    chunks = list(client.completions.create(**ask, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_32_clients_at_once_get_what_each_gets_alone_decoded_together(server):
    import httpx

    client = server.client()
    prompts = [f"{word} of the" for word in ("And", "The", "For", "In", "But", "Then", "Now", "So")] * 4
    settings = [dict(temperature=0) if i % 2 else dict(temperature=1.0, seed=i) for i in range(32)]

    def ask(i):
        return client.completions.create(model=server.name, prompt=prompts[i], max_tokens=24 + i,
                                         **settings[i]).choices[0].text
    alone = [ask(i) for i in range(32)]
    before = httpx.get(f"{server.url}/health").json()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(ask, range(32)))
    assert together == alone
    health = httpx.get(f"{server.url}/health").json()
    assert health["peak_rows"] > 8  # decoded together, in the 32-row batch
    assert health["steps"] - before["steps"] < sum(24 + i for i in range(32)) / 4
    assert health["prefills"] - before["prefills"] < 32  # prompts that arrived together, prefilled together


def test_several_prompts_and_choices_in_one_request(server):
    client = server.client()
    out = client.completions.create(model=server.name, prompt=["And God", "The earth"], n=2, max_tokens=6,
                                    temperature=1.0, seed=11)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    again = client.completions.create(model=server.name, prompt=["And God", "The earth"], n=2, max_tokens=6,
                                      temperature=1.0, seed=11)
    assert [c.text for c in out.choices] == [c.text for c in again.choices]
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.completion_tokens == 24


def test_echo_with_logprobs_scores_the_prompt_as_the_model_does(alibi_run, server):
    import httpx
    import jax

    from zerolm.checkpoint.trained_model import load

    model_run = load(str(alibi_run / "ckpt"), jax.local_devices()[:1])
    ids = model_run.tokenizer().encode("And God said, Let there be light").tolist()
    body = httpx.post(f"{server.url}/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True,
                                                            "logprobs": 5, "temperature": 0}).json()
    logprobs = body["choices"][0]["logprobs"]
    logp = jax.nn.log_softmax(model_run.model.apply({"params": model_run.params}, np.asarray([ids]))[0])
    want = [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert logprobs["token_logprobs"][0] is None and len(logprobs["tokens"]) == len(ids)
    np.testing.assert_allclose(logprobs["token_logprobs"][1:], want, rtol=1e-4)
    assert all(len(top) <= 5 and max(top.values()) >= lp for top, lp in
               zip(logprobs["top_logprobs"][1:], logprobs["token_logprobs"][1:], strict=True))
    assert body["choices"][0]["text"] == model_run.tokenizer().decode(ids)

    # At the context's edge: a window of context + 1 tokens scored (nothing drawn), as `zerolm eval --tasks`
    # scores its windows; one token more, or a token asked after a prompt as long as the context, is a 400 that
    # says what lm-evaluation-harness needs.
    ids = np.random.default_rng(0).integers(0, model_run.tokenizer().vocab_size, CONTEXT + 1).tolist()
    model = model_run.at_context(CONTEXT, "context").model
    logp = jax.nn.log_softmax(model.apply({"params": model_run.params}, np.asarray([ids[:-1]]))[0])
    for prompt in (ids, ids[:-1]):
        body = httpx.post(f"{server.api}/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True,
                                                             "logprobs": 1}).json()
        scored = body["choices"][0]["logprobs"]["token_logprobs"]
        assert len(scored) == len(prompt) and body["choices"][0]["finish_reason"] == "length", body
        np.testing.assert_allclose(scored[1:], [float(logp[i - 1, prompt[i]]) for i in range(1, len(prompt))],
                                   rtol=1e-4, atol=1e-5)
    for prompt, max_tokens in ((ids + [5], 0), (ids[:-1], 1)):
        response = httpx.post(f"{server.api}/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                                  "echo": True, "logprobs": 1})
        assert response.status_code == 400 and response.json()["error"]["message"].startswith(
            f"prompt: {len(prompt)} tokens, but the model's context is {CONTEXT} tokens"), response.text
        assert f"pass it max_length={CONTEXT}" in response.json()["error"]["message"]


def test_lm_eval_local_completions_gives_zerolm_eval_tasks_numbers_on_every_document(alibi_run, server, monkeypatch):
    """local-completions keeps a request's last max_length - 1 tokens (and asks for one token more, which it does
    not score); `zerolm eval --tasks`, as the harness's hf backend, the last context + 1. At max_length = the
    trained context + 2, which this ALiBi model served at CONTEXT takes, they score the same windows: every
    document's numbers are equal, those both cut from the left included."""
    import lm_eval

    from test_harness import LIMIT, TASKS
    from zerolm.eval import downstream
    from zerolm.eval.harness import ZerolmLM

    for variable in (*downstream.OFFLINE, "DISABLE_MULTIPROC"):
        monkeypatch.setenv(variable, "1")
    lm = ZerolmLM(checkpoint=str(alibi_run / "ckpt"))
    want = downstream.evaluate(lm, TASKS, downstream.task_manager(TASKS), limit=LIMIT, bootstrap_iters=0,
                               log_samples=True)
    args = (f"base_url={server.api}/completions,model={server.name},tokenizer_backend=remote,"
            f"max_length={lm.max_length + 2},tokenized_requests=True,num_concurrent=4,max_retries=1")
    with downstream.no_git():
        got = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=TASKS, limit=LIMIT,
                                      task_manager=downstream.task_manager(TASKS), bootstrap_iters=0, log_samples=True)
    got_scores, want_scores = per_document(got), per_document(want)
    assert got_scores.keys() == want_scores.keys() and len(want_scores) == LIMIT * len(TASKS)
    for document, scores in want_scores.items():
        assert got_scores[document] == pytest.approx(scores, rel=2e-6, abs=2e-5), document
    cut = [args for task in ("zerolm_cloze", "zerolm_choice") for sample in want["samples"][task]
           for args in sample["arguments"] if sum(len(lm.tok_encode(text)) for text in args) > lm.max_length + 1]
    assert len(cut) > 10  # the context's edge reached: requests longer than the window, cut from the left


def per_document(results) -> dict[tuple[str, int], list[float]]:
    """Each document's log-likelihoods (one per request: a choice, a continuation, a text), by task and id."""
    return {(task, sample["doc_id"]): [float(r[0] if isinstance(r, list | tuple) else r)
                                       for r in sample["filtered_resps"]]
            for task, samples in results["samples"].items() for sample in samples}


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_k": -2}, 400, "top_k"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "max_tokens": 201}, 400, "max_tokens"),
    ({"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": 3}, 400, "prompt"),
    ({"prompt": [5, 10 ** 6]}, 400, "prompt"),
    ({"prompt": "word " * 300}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "model": "not-this-one"}, 404, "model"),
    ({"prompt": "x", "max_tokens": True}, 400, "max_tokens"),  # JSON's types, as OpenAI reads them
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 5.0}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": True}, 400, "temperature"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "echo": 1}, 400, "echo"),
    ({"prompt": [1, True]}, 400, "prompt"),
])
def test_a_bad_request_is_a_4xx_naming_its_field_and_the_server_goes_on(server, body, status, param):
    import httpx

    response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert httpx.post(f"{server.url}/v1/completions", content=b"{nope",
                      headers={"Content-Type": "application/json"}).status_code == 400
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_a_huge_body_is_refused_before_it_is_read_and_health_answers_meanwhile(server):
    import httpx

    rss_before = server.rss_mb()
    huge = json.dumps({"prompt": "word " * 2_000_000}).encode()  # 10 MB, 2 million tokens

    def chunked():  # no Content-Length: refused as it passes the limit
        yield from (huge[i:i + 65536] for i in range(0, len(huge), 65536))
    long_text = json.dumps({"prompt": "word " * 200_000}).encode()  # under the limit, 200,000 tokens
    for content, status, message in [(huge, 413, "the request body is larger than this server's limit of 1048576"),
                                     (chunked(), 413, "the request body is larger than this server's limit"),
                                     (long_text, 400, "prompt: 1000000 characters, more than the model's context")]:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sent = time.perf_counter()
            answer = pool.submit(httpx.post, f"{server.api}/completions", content=content, timeout=60,
                                 headers={"Content-Type": "application/json"})
            waits = []
            while not waits or not answer.done():
                start = time.perf_counter()
                assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
                waits.append(time.perf_counter() - start)
            response, took = answer.result(), time.perf_counter() - sent
        assert max(waits) < 1.0 and took < 2.0, (waits, took)
        assert response.status_code == status and response.json()["error"]["message"].startswith(message)
    assert server.rss_mb() - rss_before < 100


@pytest.mark.parametrize("body, status, param, message", [
    (b'{"prompt": "x", "seed": 1180591620717411303424}', 400, "seed", "seed: 1180591620717411303424 is not a 64-bit"),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, None,
     "the request body is not JSON: Exceeds the limit (4300 digits) for integer string conversion"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "the request body is nested too deeply"),
    (b'{"prompt": "And \\ud800 said"}', 400, "prompt", "prompt: holds a lone surrogate"),
    (b'{"prompt": "x", "stop": "\\udfff"}', 400, "stop", "stop: holds a lone surrogate"),
    (b'{"prompt": [5, 1180591620717411303424]}', 400, "prompt", "prompt: token ids must be in [0, 2048)"),
    (b'{"prompt": "x", "max_tokens": 2, "top_k": 1099511627776}', 200, None, None),  # k past the vocabulary: all
])
def test_what_python_cannot_take_is_a_4xx_not_a_500_and_no_traceback(server, body, status, param, message):
    import httpx

    response = httpx.post(f"{server.api}/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    if status != 200:
        error = response.json()["error"]
        assert error["param"] == param and error["message"].startswith(message), error
    assert "Traceback" not in server.log() and "error:" not in server.log(), server.log()[-2000:]


def test_a_page_of_another_site_cannot_use_the_server_through_its_visitors_browser(server):
    import httpx

    own = server.url.removeprefix("http://")  # 127.0.0.1:port
    port = own.rsplit(":", 1)[1]
    body = json.dumps({"prompt": "And", "max_tokens": 1})
    for headers, status, message in [
        # a "simple" request, which a browser sends another site without asking: from another site's page,
        # through a name of its own pointed at 127.0.0.1 (DNS rebinding), as text
        ({"Content-Type": "text/plain", "Origin": "http://evil.example", "Host": f"evil.example:{port}"}, 403,
         f"Host 'evil.example:{port}' is not a name of this server"),
        ({"Content-Type": "text/plain"}, 415, "Content-Type text/plain: a request's body is JSON"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "Content-Type application/x-www-form"),
        ({"Content-Type": "application/json", "Origin": "http://evil.example"}, 403,
         "Origin 'http://evil.example' is not this server's own"),
        ({"Content-Type": "application/json", "Origin": "null"}, 403, "Origin 'null' is not this server's own"),
        ({"Content-Type": "application/json", "Host": f"evil.example:{port}"}, 403, "Host 'evil.example:"),
        ({"Content-Type": "application/json", "Origin": server.url}, 200, None),  # the server's own page
        ({"Content-Type": "application/json; charset=utf-8", "Host": f"localhost:{port}"}, 200, None),
        ({"Content-Type": "application/json", "Origin": ALLOWED}, 200, None),  # --allow-origin's
    ]:
        response = httpx.post(f"{server.api}/completions", content=body, headers=headers)
        assert response.status_code == status, (headers, response.text)
        if message is not None:
            assert response.json()["error"]["message"].startswith(message), response.text
    assert response.headers["access-control-allow-origin"] == ALLOWED  # its page may read the answer
    preflight = {"Origin": ALLOWED, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
    assert httpx.options(f"{server.api}/completions", headers=preflight).status_code == 200
    preflight["Origin"] = "http://evil.example"
    assert httpx.options(f"{server.api}/completions", headers=preflight).status_code == 403
    assert httpx.get(f"{server.url}/health", headers={"Host": "evil.example"}).status_code == 403


def test_the_end_of_the_context_ends_a_completion(server):
    import httpx

    ids = list(range(10, 10 + CONTEXT - 5))
    body = httpx.post(f"{server.url}/v1/completions", json={"prompt": ids, "max_tokens": 200, "temperature": 0,
                                                            "stop": "\u2603"}, timeout=60).json()
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert body["usage"]["completion_tokens"] <= 5


def test_the_page_streams_what_zerolm_sample_prints_and_says_when_the_server_dies(alibi_run, server):
    playwright = pytest.importorskip("playwright.sync_api")
    want = sample(alibi_run, "And God said", "--temperature", "0", "--max-new-tokens", "30")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            assert server.name in page.inner_text("h1")
            page.fill("#prompt", "And God said")
            page.fill("#max_tokens", "30")
            page.check("#greedy")
            page.click("#generate")
            page.wait_for_function("document.getElementById('status').textContent.startsWith('length')")
            assert page.inner_text("#completion") == want
            page.uncheck("#greedy")
            page.fill("#temperature", "-3")
            page.click("#generate")
            page.wait_for_function("document.getElementById('status').className === 'error'")
            assert "temperature: -3.0 must be >= 0" in page.inner_text("#status")

            dying = Server(alibi_run / "ckpt", "--context", "4096")
            page.goto(dying.url + "/")
            page.fill("#prompt", "And")
            page.fill("#max_tokens", "4000")
            page.check("#greedy")  # sampled, the answer may end at an end-of-text before the kill: greedy runs 4000
            page.click("#generate")
            page.wait_for_function("document.getElementById('completion').textContent.length > 20")
            dying.stop(signal.SIGKILL)
            page.wait_for_function("document.getElementById('status').className === 'error'", timeout=20_000)
            assert "connection was lost" in page.inner_text("#status")
            assert page.is_enabled("#generate")
        finally:
            browser.close()


def chromium() -> str:
    for path in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if os.path.exists(path):
            return path
    pytest.fail("no chromium: `make install-test` installs Debian's (apt-get install chromium)")


def test_sigterm_lets_the_answers_in_flight_finish_ends_the_longer_with_an_error_then_exits_0(alibi_run):
    import httpx
    import openai

    s = Server(alibi_run / "ckpt", "--context", "4096", "--grace", "3")
    longer = s.client().completions.create(model=s.name, prompt="And", max_tokens=4000, stream=True,
                                           temperature=0)  # past the grace (greedy: no end-of-text before it)
    drawn = [next(iter(longer)).choices[0].text]
    texts: list[str] = []
    streaming = threading.Event()

    def stream():  # 100 tokens, all but the first drawn after SIGTERM: within the grace
        with httpx.stream("POST", f"{s.api}/completions", json={"prompt": "And", "max_tokens": 100, "stream": True,
                                                                "temperature": 0}, timeout=60) as response:
            for line in response.iter_lines():
                streaming.set()
                texts.append(line)
    reader = threading.Thread(target=stream)
    reader.start()
    assert streaming.wait(timeout=60)
    s.proc.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError, match="the server stopped before this answer finished"):
        drawn.extend(chunk.choices[0].text for chunk in longer)
    assert s.proc.wait(timeout=60) == 0
    reader.join()
    assert texts[-2:] == ["data: [DONE]", ""] or texts[-1] == "data: [DONE]"
    assert '"finish_reason": "length"' in "".join(texts)
    assert len(drawn) > 10  # it was streaming when the grace ran out
    log = s.log()
    assert log.count("stopping: cut a streamed answer in flight") == 1 and "stopped" in log
    assert "Traceback" not in log and "Cancel" not in log, log


def test_the_client_of_a_server_killed_mid_stream_gets_an_error_not_a_hang(alibi_run):
    import openai

    s = Server(alibi_run / "ckpt", "--context", "4096")
    stream = s.client().completions.create(model=s.name, prompt="And", max_tokens=4000, stream=True,
                                           temperature=0)  # greedy: no end-of-text before the kill (sampled can)
    next(iter(stream))
    s.stop(signal.SIGKILL)
    with pytest.raises(openai.APIConnectionError):
        for _ in stream:
            pass


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "error: --port: 70000 is out of range"),
    (["--context", "4096"], "--context: 4096 tokens is past the model's trained context of 32"),
    (["--host", "no.such.host.invalid"], "error: --host no.such.host.invalid --port 8000: cannot listen there"),
    (["--allow-origin", "http://a.example,evil"], "error: --allow-origin: 'evil' is not an origin"),
])
def test_bad_flags_are_one_line_and_exit_2(trained_run, flags, message):
    proc = zerolm("serve", "--checkpoint", trained_run / "ckpt", *flags, expect=2, devices=1)
    assert message in proc.stderr.splitlines()[0] and "Traceback" not in proc.stderr


def test_a_port_in_use_is_one_line_and_exit_2(server, alibi_run):
    port = server.url.rsplit(":", 1)[1]
    proc = zerolm("serve", "--checkpoint", alibi_run / "ckpt", "--port", port, expect=2, devices=1)
    assert proc.stderr.splitlines()[0].startswith(f"error: --host 127.0.0.1 --port {port}: cannot listen there")


def test_nothing_compiles_once_the_engine_is_ready(trained_run):
    """Every program a request runs is compiled before /health says ready: bursts of prompts of every bucket,
    into batches of every row count, add none (a compile under load stalls every row)."""
    import threading

    import jax

    from zerolm.checkpoint.trained_model import load
    from zerolm.config.sampling import Sampling
    from zerolm.model import generate
    from zerolm.serve.engine import Engine, Job

    model_run = load(str(trained_run / "ckpt"), jax.local_devices()[:1])
    engine = Engine(model_run.model, model_run.params, model_run.tokenizer(), (1, 8, 32))
    engine.start()
    engine.ready.wait()
    programs = (generate.prefill, generate.insert, generate.step, generate.regroup)
    compiled = [program._cache_size() for program in programs]
    done = threading.Semaphore(0)

    def job(i: int, n: int, new: int) -> Job:
        def sink(event) -> None:
            if getattr(event, "finish_reason", "failed") is not None:
                done.release()
        return Job(0, np.arange(1, n + 1, dtype=np.int32), "", Sampling(temperature=1.0), jax.random.key(i), new,
                   [], False, None, sink)
    rng = np.random.default_rng(0)
    for burst in (1, 3, 16, 9, 40, 2):
        jobs = [job(i, int(rng.integers(1, 32)), int(rng.integers(1, 12))) for i in range(burst)]
        engine.submit(jobs)
        for _ in jobs:
            assert done.acquire(timeout=60)
    engine.stop()
    assert [program._cache_size() for program in programs] == compiled


def test_a_full_queue_is_429_before_anything_runs(trained_run):
    import jax
    from starlette.testclient import TestClient

    from zerolm.checkpoint.trained_model import load
    from zerolm.serve.app import Served, create_app
    from zerolm.serve.engine import Engine

    model_run = load(str(trained_run / "ckpt"), jax.local_devices()[:1])
    engine = Engine(model_run.model, model_run.params, model_run.tokenizer(), (1, 2), max_waiting=2)  # not started
    client = TestClient(create_app(Served(engine, "tiny")), base_url="http://localhost")
    assert client.get("/health").status_code == 503  # not ready: its engine has not started
    engine.waiting.extend([None, None])  # two choices wait for a row
    response = client.post("/v1/completions", json={"prompt": "And", "max_tokens": 3})
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "rate_limit_exceeded"
    response = client.post("/v1/completions", json={"prompt": "And", "n": 3})
    assert response.status_code == 400 and response.json()["error"]["message"] == "n: 3 must be in [1, 2]"
