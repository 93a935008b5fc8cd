"""The service's web page in a real headless Chromium (Debian's chromium and
chromium-driver, driven by Selenium): it loads, its translation equals the
API's, and an over-long text shows the service's error.

Skipped where Selenium or the browser is missing (``.ci/run`` installs both:
``apt-get install chromium chromium-driver``).
"""
import contextlib
import shutil

import pytest

httpx = pytest.importorskip('httpx')
pytest.importorskip('uvicorn')
webdriver = pytest.importorskip('selenium.webdriver')
CHROMIUM = shutil.which('chromium') or shutil.which('chromium-browser')
CHROMEDRIVER = shutil.which('chromedriver')
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason='needs Debian\'s chromium and chromium-driver '
    '(apt-get install chromium chromium-driver)')

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from tests.local_server import serve_in_thread  # noqa: E402
from xfmr_jax import data, service, serving  # noqa: E402


@pytest.fixture(scope='module')
def url(exported_artifact):
  app = service.make_app(serving.load(str(exported_artifact)), max_texts=8)
  with serve_in_thread(app) as base:
    yield base


@pytest.fixture(scope='module')
def browser(tmp_path_factory):
  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  for arg in ('--headless=new', '--no-sandbox', '--disable-dev-shm-usage',
              '--disable-gpu',
              f'--user-data-dir={tmp_path_factory.mktemp("chromium")}'):
    options.add_argument(arg)
  driver = webdriver.Chrome(
      options=options, service=webdriver.ChromeService(CHROMEDRIVER))
  with contextlib.closing(driver):
    yield driver


def _translate_in_page(browser, url, text, beam_size):
  browser.get(url + '/')
  # On a loaded machine the new page can still be loading here.
  box = WebDriverWait(browser, 30).until(
      lambda b: b.find_elements(By.ID, 'source'))[0]
  box.clear()
  # send_keys types a newline as Enter, which the page leaves to the box
  box.send_keys(text)
  beam = browser.find_element(By.ID, 'beam')
  beam.find_element(By.CSS_SELECTOR, f'option[value="{beam_size}"]').click()
  browser.find_element(By.ID, 'translate').click()
  wait = WebDriverWait(browser, 120)
  wait.until(lambda b: b.find_element(By.ID, 'latency').text
             or b.find_element(By.ID, 'error').text)
  return (browser.find_element(By.ID, 'output').text,
          browser.find_element(By.ID, 'error').text,
          browser.find_element(By.ID, 'latency').text)


def test_the_page_translates_as_the_api_does(browser, url, data_dir):
  test = data.get_source('toy_translate/small', 'test', str(data_dir))
  texts = [test[0][0], test[1][0]]
  browser.get(url + '/')
  assert browser.title == 'xfmr_jax translator'
  options = [o.get_attribute('value') for o in browser.find_elements(
      By.CSS_SELECTOR, '#beam option')]
  assert options == ['4', '1']
  assert not browser.find_element(By.ID, 'key-label').is_displayed()
  for beam_size in (4, 1):
    want = httpx.post(url + '/translate', json={
        'texts': texts, 'beam_size': beam_size}, timeout=120).json()
    output, error, latency = _translate_in_page(browser, url,
                                                '\n'.join(texts), beam_size)
    assert error == ''
    assert output.split('\n') == want['translations']
    assert latency.endswith(' ms') and int(latency.split()[0]) >= 0


def test_an_over_long_text_shows_the_error(browser, url):
  output, error, latency = _translate_in_page(browser, url, 'z ' * 190, 4)
  assert error.startswith('413: ') and 'more than the model maximum' in error
  assert output == '' and latency == ''
