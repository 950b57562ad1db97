"""The web page at / (server/static/index.html) in a real browser: Debian's chromium, driven by Selenium through
Debian's chromedriver (nothing downloads a browser), against a real server's HTTP front. A newcomer's session:
pick the model, type a text, read the translation as it streams in sentence by sentence, ask for alternatives."""

import pytest
import requests

from nmtserve.server.config import ServerConfig
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread, system_tool

TEXT = "the cat sees the dog. we are happy ."


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = system_tool("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(system_tool("chromedriver")), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(tiny_bundle):
    running = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                                   http_port=0, max_decoding_length=64))
    yield running
    running.stop()


def test_a_user_types_a_text_and_reads_its_translation_stream_in(browser, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    url = f"http://127.0.0.1:{server.running.http_port}/"
    page = requests.get(url, timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    with server.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        expected = stub.TranslateText(pb.TranslateTextRequest(texts=[TEXT]), timeout=60).translations[0].text
        nbest = stub.Translate(pb.TranslateRequest(sentences=[TEXT], options=pb.DecodingOptions(
            beam_size=4, num_hypotheses=4, return_scores=True)), timeout=60).translations[0]
    browser.get(url)
    wait = WebDriverWait(browser, 30)
    wait.until(lambda b: b.find_element(By.ID, "model").text)  # the models are listed
    assert "en→fr" in browser.find_element(By.ID, "model").text
    browser.find_element(By.ID, "source").send_keys(TEXT)
    browser.find_element(By.ID, "translate").click()
    wait.until(lambda b: b.find_element(By.ID, "latency").text)  # shown once the stream has ended
    assert browser.find_element(By.ID, "target").text == expected
    assert browser.find_element(By.ID, "latency").text.startswith("first sentence ")
    wait.until(ready.element_to_be_clickable((By.ID, "alternatives"))).click()
    wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#nbest li")) == 4)
    listed = browser.execute_script("return [...document.querySelectorAll('#nbest li')].map(li => li.firstChild.textContent)")
    assert listed == [nbest.text, *(a.text for a in nbest.alternatives)]
    scores = [span.text for span in browser.find_elements(By.CSS_SELECTOR, "#nbest li .score")]
    assert scores == [f"{h.score:.3f}, confidence {h.confidence:.2f}" for h in (nbest, *nbest.alternatives)]
    assert browser.find_element(By.ID, "error").text == ""


def test_the_page_shows_the_servers_error(browser, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"http://127.0.0.1:{server.running.http_port}/")
    wait = WebDriverWait(browser, 30)
    wait.until(lambda b: b.find_element(By.ID, "model").text)
    browser.execute_script("document.getElementById('source').value = arguments[0]", "x " * 12_000)  # over --max-text-chars
    browser.find_element(By.ID, "translate").click()
    wait.until(lambda b: b.find_element(By.ID, "error").text)
    assert "characters, the limit is" in browser.find_element(By.ID, "error").text
