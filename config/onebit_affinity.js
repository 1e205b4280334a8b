// The affinity key of a request, for config/nginx.conf ("js_set $onebit_affinity affinity.key",
// then "hash $onebit_affinity consistent"): nginx has no JSON parser of its own, and this njs
// module (Debian's libnginx-mod-http-js) reads the body for it.  The same keys as
// config/haproxy.cfg, in the same order (docs/operations.md, "Affinity by conversation"):
//   1. a key the client gives: OpenAI's "prompt_cache_key" (Chat Completions, Responses),
//      Anthropic's "metadata.user_id" (Messages), llama-server's X-Conversation-Id header, or the
//      older X-Session-Id header;
//   2. a prefix of the prompt that every turn repeats: the Responses API's "instructions",
//      Anthropic's "system", the first input item, the first message (usually the system prompt);
//   3. the body's first 1024 characters (a body this module cannot parse, or none of the above);
//   4. nothing (no body, no header): an empty key, which nginx spreads round-robin.
// The body is there only when nginx kept it in memory: config/nginx.conf sets
// client_body_buffer_size to client_max_body_size so that it always does.  A body nginx wrote
// to a temporary file reads as undefined here, and the request is hashed on its headers alone.

var PREFIX_CHARS = 1024;

function text(value) {
    // A string, or the first part's text of a list of content parts ([{"type": "text", ...}]).
    if (typeof value === 'string') {
        return value;
    }
    if (Array.isArray(value) && value.length > 0 && value[0] && typeof value[0].text === 'string') {
        return value[0].text;
    }
    return '';
}

function first(list) {
    return Array.isArray(list) && list.length > 0 && list[0] ? text(list[0].content) : '';
}

function key(r) {
    var body = r.requestText;
    var request = null;
    if (body) {
        try {
            request = JSON.parse(body);
        } catch (e) {
            request = null;
        }
    }
    var given = request !== null && typeof request === 'object' ? request : {};
    var metadata = given.metadata && typeof given.metadata === 'object' ? given.metadata : {};
    var candidates = [
        text(given.prompt_cache_key),
        text(metadata.user_id),
        r.headersIn['X-Conversation-Id'] || '',
        r.headersIn['X-Session-Id'] || '',
        text(given.instructions),
        text(given.system),
        first(given.input),
        first(given.messages),
        body ? body.slice(0, PREFIX_CHARS) : ''
    ];
    for (var i = 0; i < candidates.length; i++) {
        if (candidates[i]) {
            return candidates[i];
        }
    }
    return '';
}

export default {key: key};
