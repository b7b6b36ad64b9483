// What the chunked, resumable uploads share: a dataset's files (upload.js) and a new job's folder
// (folder.js). A plain script, loaded before either, that defines one global, window.E31Chunks:
//
//   client(csrf) -> {request, json}  requests that send the CSRF token and read the JSON answer
//                                    ({status, ok, data}; data is {} when the body is not JSON)
//   patiently(send, options)         one request, tried again after a network failure or a
//                                    server error (below)
//   sleep(ms), Refused, Unreachable, MAX_TRIES, FIRST_PAUSE_MS
(function () {
  "use strict";

  const MAX_TRIES = 5;
  const FIRST_PAUSE_MS = 500;

  // Errors a retry cannot mend (the server refused with a reason) and those it may (tried
  // MAX_TRIES times).
  class Refused extends Error {}
  class Unreachable extends Error {}

  function sleep(ms) {
    return new Promise((resolve) => setTimeout(resolve, ms));
  }

  function client(csrf) {
    async function request(method, url, body, headers) {
      const options = { method, headers: { "X-CSRFToken": csrf, Accept: "application/json", ...headers }, credentials: "same-origin" };
      if (body !== undefined) options.body = body;
      const response = await fetch(url, options);
      let data = {};
      try {
        data = await response.json();
      } catch (_) {
        data = {};
      }
      return { status: response.status, ok: response.ok, data };
    }

    function json(method, url, payload) {
      return request(method, url, payload === undefined ? undefined : JSON.stringify(payload), { "Content-Type": "application/json" });
    }

    return { request, json };
  }

  // One request (send(), a promise of request's answer), tried again after a network failure or
  // a server error, pausing 0.5, 1, 2, 4 s. A 409 with `received` is an answer too: the server
  // says where to continue. Another 4xx (but 408 and 429) throws Refused with the server's
  // reason; MAX_TRIES failures throw Unreachable. The options:
  //   what       what is asked, in "The server refused {what} (HTTP 400)."
  //   name       the same in "{name} failed 5 times (why)." (what unless given)
  //   reason     data -> the server's reason for refusing ("" for none): data.detail unless given
  //   check      called before each try: throws to stop trying
  //   retrying   text -> shows "retrying in 1 s (try 3 of 5)" before the pause
  //   recovered  called when an answer comes after a try that failed
  async function patiently(send, options) {
    const { what, name = what, reason = (data) => data.detail, check, retrying, recovered } = options;
    for (let attempt = 1; ; attempt += 1) {
      if (check) check();
      let answer = null;
      try {
        answer = await send();
      } catch (_) {
        answer = null; // the network: no answer at all
      }
      if (answer && (answer.ok || (answer.status === 409 && typeof answer.data.received === "number"))) {
        if (recovered && attempt > 1) recovered();
        return answer;
      }
      if (answer && answer.status >= 400 && answer.status < 500 && answer.status !== 408 && answer.status !== 429) {
        throw new Refused(reason(answer.data) || `The server refused ${what} (HTTP ${answer.status}).`);
      }
      if (attempt >= MAX_TRIES) {
        const why = answer ? `the server answered HTTP ${answer.status}` : "the server could not be reached";
        throw new Unreachable(`${name} failed ${MAX_TRIES} times (${why}).`);
      }
      const pause = FIRST_PAUSE_MS * 2 ** (attempt - 1);
      if (retrying) retrying(`retrying in ${pause / 1000} s (try ${attempt + 1} of ${MAX_TRIES})`);
      await sleep(pause);
    }
  }

  window.E31Chunks = Object.freeze({ MAX_TRIES, FIRST_PAUSE_MS, Refused, Unreachable, sleep, client, patiently });
})();
