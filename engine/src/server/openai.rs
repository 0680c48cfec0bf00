//! OpenAI's request formats, read and checked into what the engine takes.
//!
//! Bodies are parsed into `serde_json::Value` first and read field by field, so that every
//! refusal names the field at fault (`messages[1].content[0].type`, `temperature`) and says what
//! was expected and what was found; a typed serde derive would report a line and column instead.
//! Fields ember does not know are ignored, as OpenAI's own server does; fields it knows but does
//! not implement (`tools`, `response_format` with a schema, `logit_bias`, ...) are refused with a
//! 400 that names them rather than dropped, because dropping them would silently change what the
//! client asked for. Omitted sampling fields take llama-server's defaults.

use serde_json::{Map, Value};

use super::error::ApiError;
use crate::engine::{GenerateRequest, MAX_TOP_LOGPROBS};
use crate::sample::{SamplerParams, SamplingParam};

/// OpenAI's limit on stop sequences.
pub const MAX_STOP_SEQUENCES: usize = 4;
/// The largest `max_tokens` accepted (larger values are almost always a client bug; a request
/// that should run to the end of the context can leave `max_tokens` out).
pub const MAX_MAX_TOKENS: i64 = i32::MAX as i64;

/// The fields chat and text completions share.
#[derive(Debug, Clone, PartialEq)]
pub struct CommonParams {
    /// The `model` field, if given.
    pub model: Option<String>,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `max_completion_tokens`, else `max_tokens`.
    pub max_tokens: Option<usize>,
    /// Temperature, top-k/p, min-p, penalties; the seed is drawn when the request has none.
    pub sampling: SamplerParams,
    /// `seed` as given.
    pub seed: Option<u64>,
    /// `stop`.
    pub stop: Vec<String>,
    /// `ignore_eos` (a vLLM and llama-server extension).
    pub ignore_eos: bool,
    /// `return_token_ids` (a vLLM extension): the prompt's and the output's token ids in the
    /// response.
    pub return_token_ids: bool,
}

impl CommonParams {
    /// The engine request for `prompt`, with `logprobs` alternatives per token when asked;
    /// `random_seed` is used when the request gave no seed.
    pub fn into_generate(
        self,
        prompt: Vec<u32>,
        logprobs: Option<usize>,
        random_seed: u64,
    ) -> GenerateRequest {
        let mut sampling = self.sampling;
        sampling.seed = self.seed.unwrap_or(random_seed);
        GenerateRequest {
            prompt,
            max_tokens: self.max_tokens,
            sampling,
            stop: self.stop,
            logprobs,
            ignore_eos: self.ignore_eos,
            report_eog: false,
        }
    }
}

/// A `POST /v1/chat/completions` body, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub common: CommonParams,
    /// The conversation, text parts joined.
    pub messages: Vec<ember_tokenizer::ChatMessage>,
    /// `Some(n)`: `logprobs: true` with `top_logprobs: n` (0 when not given).
    pub logprobs: Option<usize>,
}

/// What `prompt` of a text completion holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Text, tokenized as `ember run -p` does.
    Text(String),
    /// Token ids, evaluated as given.
    Tokens(Vec<u32>),
}

/// A `POST /v1/completions` body, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub common: CommonParams,
    pub prompt: Prompt,
    /// The legacy integer `logprobs`: alternatives per token.
    pub logprobs: Option<usize>,
}

/// Renders a JSON value for an error message, shortened when long.
pub(crate) fn shown(value: &Value) -> String {
    const LIMIT: usize = 80;
    let text = value.to_string();
    if text.chars().count() <= LIMIT {
        text
    } else {
        let cut: String = text.chars().take(LIMIT).collect();
        format!("{cut}...")
    }
}

/// What kind of JSON value this is, for error messages.
fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// An integer if the number is one (`5` or `5.0`), else `None`.
fn as_integer(value: &Value) -> Option<i128> {
    let number = value.as_number()?;
    if let Some(i) = number.as_i64() {
        return Some(i as i128);
    }
    if let Some(u) = number.as_u64() {
        return Some(u as i128);
    }
    let f = number.as_f64()?;
    // Integral floats within i64's range are integers (pydantic, behind OpenAI's server, takes
    // 5.0 for 5 as well); beyond it they are out of any range asked for below.
    (f.is_finite() && f.fract() == 0.0 && f.abs() < 9.2e18).then_some(f as i128)
}

/// Reads the fields of one JSON object, naming them by their path in errors.
pub struct Fields<'a> {
    map: &'a Map<String, Value>,
    path: String,
}

impl<'a> Fields<'a> {
    /// The top-level object of a body.
    pub fn root(value: &'a Value) -> Result<Fields<'a>, ApiError> {
        match value {
            Value::Object(map) => Ok(Fields {
                map,
                path: String::new(),
            }),
            other => Err(ApiError::bad_request(format!(
                "the request body is {}: expected a JSON object",
                kind_of(other)
            ))),
        }
    }

    /// A nested object found at `param`.
    fn nested(map: &'a Map<String, Value>, path: String) -> Fields<'a> {
        Fields { map, path }
    }

    /// The full name of a field of this object.
    pub fn param(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.path)
        }
    }

    /// A field's value; `null` counts as absent, as in OpenAI's API.
    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }

    fn wrong_type(&self, name: &str, expected: &str, found: &Value) -> ApiError {
        let param = self.param(name);
        ApiError::invalid(
            &param,
            format!("{param}: expected {expected}, found {}", shown(found)),
        )
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(self.wrong_type(name, "true or false", other)),
        }
    }

    pub fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.wrong_type(name, "a string", other)),
        }
    }

    /// A number within `min..=max`.
    pub fn number(&self, name: &str, min: f64, max: f64) -> Result<Option<f64>, ApiError> {
        let expected = format!("a number from {min} to {max}");
        match self.get(name) {
            None => Ok(None),
            Some(value) => match value.as_f64() {
                Some(x) if x.is_finite() && (min..=max).contains(&x) => Ok(Some(x)),
                _ => Err(self.wrong_type(name, &expected, value)),
            },
        }
    }

    /// An integer within `min..=max`.
    pub fn integer(&self, name: &str, min: i64, max: i64) -> Result<Option<i64>, ApiError> {
        let expected = format!("an integer from {min} to {max}");
        match self.get(name) {
            None => Ok(None),
            Some(value) => match as_integer(value) {
                Some(i) if (min as i128..=max as i128).contains(&i) => Ok(Some(i as i64)),
                _ => Err(self.wrong_type(name, &expected, value)),
            },
        }
    }

    /// An object field, read with its own [`Fields`].
    pub fn object(&self, name: &str) -> Result<Option<Fields<'a>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Fields::nested(map, self.param(name)))),
            Some(other) => Err(self.wrong_type(name, "an object", other)),
        }
    }

    /// Refuses a field ember does not implement, when present and not null.
    pub fn refuse(&self, name: &str, why: &str) -> Result<(), ApiError> {
        match self.get(name) {
            None => Ok(()),
            Some(_) => {
                let param = self.param(name);
                Err(ApiError::unsupported(
                    &param,
                    format!("{param} is not supported by ember: {why}"),
                ))
            }
        }
    }
}

/// Reads the fields chat and text completions share. `max_logprobs_param` is checked by the
/// callers, which differ in how logprobs are asked for.
/// A sampling parameter's field, checked against its range ([`SamplingParam::range`], the same
/// limits the command line and the engine apply).
fn sampling_number(fields: &Fields<'_>, param: SamplingParam) -> Result<Option<f64>, ApiError> {
    let (min, max) = param.range();
    fields.number(param.field(), min, max)
}

fn common_params(fields: &Fields<'_>) -> Result<CommonParams, ApiError> {
    let model = fields.string("model")?.map(str::to_string);
    let stream = fields.bool("stream")?.unwrap_or(false);
    let include_usage = match fields.object("stream_options")? {
        Some(options) => options.bool("include_usage")?.unwrap_or(false),
        None => false,
    };
    let max_tokens = fields.integer("max_tokens", 1, MAX_MAX_TOKENS)?;
    let max_completion_tokens = fields.integer("max_completion_tokens", 1, MAX_MAX_TOKENS)?;
    let max_tokens = max_completion_tokens.or(max_tokens).map(|n| n as usize);

    if let Some(n) = fields.integer("n", i64::MIN, i64::MAX)? {
        if n != 1 {
            return Err(ApiError::unsupported(
                "n",
                format!("n: only 1 choice per request is supported, found {n}"),
            ));
        }
    }

    let mut sampling = SamplerParams::default();
    if let Some(t) = sampling_number(fields, SamplingParam::Temperature)? {
        sampling.temperature = t as f32;
    }
    if let Some(p) = sampling_number(fields, SamplingParam::TopP)? {
        sampling.top_p = p as f32;
    }
    if let Some(k) = fields.integer("top_k", -1, i32::MAX as i64)? {
        // vLLM and llama-server take -1 (and 0) for "no top-k".
        sampling.top_k = k.max(0) as usize;
    }
    if let Some(p) = sampling_number(fields, SamplingParam::MinP)? {
        sampling.min_p = p as f32;
    }
    if let Some(p) = sampling_number(fields, SamplingParam::PresencePenalty)? {
        sampling.presence_penalty = p as f32;
    }
    if let Some(p) = sampling_number(fields, SamplingParam::FrequencyPenalty)? {
        sampling.frequency_penalty = p as f32;
    }
    // llama-server's and vLLM's names for the multiplicative repetition penalty.
    for name in ["repeat_penalty", "repetition_penalty"] {
        let (min, max) = SamplingParam::RepeatPenalty.range();
        if let Some(p) = fields.number(name, min, max)? {
            sampling.repeat_penalty = p as f32;
        }
    }
    if let Some(n) = fields.integer("repeat_last_n", 0, 1 << 20)? {
        sampling.penalty_last_n = n as usize;
    }
    // OpenAI's seed is any integer; negative ones are taken by their bits.
    let seed = match fields.get("seed") {
        None => None,
        Some(value) => match as_integer(value) {
            Some(s) if (i64::MIN as i128..=u64::MAX as i128).contains(&s) => Some(s as u64),
            _ => return Err(fields.wrong_type("seed", "an integer", value)),
        },
    };

    let stop = match fields.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP_SEQUENCES {
                return Err(ApiError::invalid(
                    "stop",
                    format!(
                        "stop: expected at most {MAX_STOP_SEQUENCES} sequences, found {}",
                        items.len()
                    ),
                ));
            }
            let mut stop = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                match item {
                    Value::String(s) => stop.push(s.clone()),
                    other => {
                        return Err(ApiError::invalid(
                            format!("stop[{i}]"),
                            format!("stop[{i}]: expected a string, found {}", shown(other)),
                        ))
                    }
                }
            }
            stop
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "stop: expected a string or a list of strings, found {}",
                    shown(other)
                ),
            ))
        }
    };
    if let Some(i) = stop.iter().position(|s| s.is_empty()) {
        let param = if matches!(fields.get("stop"), Some(Value::Array(_))) {
            format!("stop[{i}]")
        } else {
            "stop".to_string()
        };
        return Err(ApiError::invalid(
            &param,
            format!("{param}: expected a non-empty string, found \"\""),
        ));
    }
    let ignore_eos = fields.bool("ignore_eos")?.unwrap_or(false);
    let return_token_ids = fields.bool("return_token_ids")?.unwrap_or(false);

    // Fields that would change what the client gets, which ember does not implement.
    if let Some(bias) = fields.get("logit_bias") {
        match bias {
            Value::Object(map) if map.is_empty() => {}
            Value::Object(_) => fields.refuse("logit_bias", "token biases are not implemented")?,
            other => return Err(fields.wrong_type("logit_bias", "an object", other)),
        }
    }
    Ok(CommonParams {
        model,
        stream,
        include_usage,
        max_tokens,
        sampling,
        seed,
        stop,
        ignore_eos,
        return_token_ids,
    })
}

/// Checks a chat completion body.
pub fn parse_chat(body: &Value) -> Result<ChatRequest, ApiError> {
    let fields = Fields::root(body)?;
    let common = common_params(&fields)?;

    // Tool calling and structured output are not implemented: refuse rather than answer as if
    // the client had not asked.
    match fields.get("tools") {
        Some(Value::Array(tools)) if tools.is_empty() => {}
        _ => fields.refuse("tools", "tool calling is not implemented")?,
    }
    match fields.get("tool_choice") {
        None => {}
        Some(Value::String(choice)) if choice == "none" => {}
        // With no tools, "auto" chooses none, so it asks for nothing ember lacks.
        Some(Value::String(choice))
            if choice == "auto"
                && !matches!(fields.get("tools"), Some(Value::Array(t)) if !t.is_empty()) => {}
        Some(_) => fields.refuse("tool_choice", "tool calling is not implemented")?,
    }
    fields.refuse("functions", "function calling is not implemented")?;
    match fields.get("function_call") {
        None => {}
        Some(Value::String(choice)) if choice == "none" => {}
        Some(_) => fields.refuse("function_call", "function calling is not implemented")?,
    }
    if let Some(format) = fields.object("response_format")? {
        match format.string("type")? {
            Some("text") => {}
            Some(_) => format.refuse("type", "only {\"type\": \"text\"} is implemented")?,
            None => {
                return Err(ApiError::invalid(
                    format.param("type"),
                    "response_format.type: expected \"text\", found nothing",
                ))
            }
        }
    }
    fields.refuse("audio", "audio output is not implemented")?;
    if let Some(modalities) = fields.get("modalities") {
        let text_only = matches!(modalities, Value::Array(m)
            if m.iter().all(|x| x.as_str() == Some("text")));
        if !text_only {
            fields.refuse("modalities", "only [\"text\"] is implemented")?;
        }
    }
    fields.refuse("prediction", "predicted outputs are not implemented")?;
    fields.refuse("web_search_options", "web search is not implemented")?;
    fields.refuse(
        "reasoning_effort",
        "the served model has no reasoning effort setting",
    )?;

    let logprobs = fields.bool("logprobs")?.unwrap_or(false);
    let top_logprobs = fields.integer("top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?;
    if top_logprobs.is_some() && !logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "top_logprobs: needs logprobs set to true",
        ));
    }
    let logprobs = logprobs.then(|| top_logprobs.unwrap_or(0) as usize);

    let messages = parse_messages(&fields)?;
    Ok(ChatRequest {
        common,
        messages,
        logprobs,
    })
}

/// The roles a chat template knows; `developer` is OpenAI's newer name for `system`.
fn role_of(role: &str) -> Option<&'static str> {
    match role {
        "system" | "developer" => Some("system"),
        "user" => Some("user"),
        "assistant" => Some("assistant"),
        _ => None,
    }
}

fn parse_messages(fields: &Fields<'_>) -> Result<Vec<ember_tokenizer::ChatMessage>, ApiError> {
    let items = match fields.map.get("messages") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "messages",
                "messages: expected a list of messages, found nothing",
            ))
        }
        Some(Value::Array(items)) => items,
        Some(other) => return Err(fields.wrong_type("messages", "a list of messages", other)),
    };
    if items.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "messages: expected at least one message, found an empty list",
        ));
    }
    let mut messages = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let path = format!("messages[{i}]");
        let Value::Object(map) = item else {
            return Err(ApiError::invalid(
                &path,
                format!(
                    "{path}: expected an object with role and content, found {}",
                    shown(item)
                ),
            ));
        };
        let message = Fields::nested(map, path.clone());
        let role = match message.string("role")? {
            Some(role) => role,
            None => {
                let param = message.param("role");
                return Err(ApiError::invalid(
                    &param,
                    format!("{param}: expected system, user or assistant, found nothing"),
                ));
            }
        };
        let Some(template_role) = role_of(role) else {
            let param = message.param("role");
            return Err(ApiError::unsupported(
                &param,
                format!("{param}: the role {role:?} is not supported: expected system, developer, user or assistant"),
            ));
        };
        message.refuse("tool_calls", "tool calling is not implemented")?;
        message.refuse("function_call", "function calling is not implemented")?;
        message.refuse("audio", "audio is not implemented")?;
        let content = parse_content(&message)?;
        messages.push(ember_tokenizer::ChatMessage::new(template_role, content));
    }
    Ok(messages)
}

/// A message's content: a string, or a list of text parts (joined with newlines, as vLLM does).
fn parse_content(message: &Fields<'_>) -> Result<String, ApiError> {
    let param = message.param("content");
    match message.get("content") {
        None => Err(ApiError::invalid(
            &param,
            format!("{param}: expected a string or a list of text parts, found nothing"),
        )),
        Some(Value::String(text)) => Ok(text.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let part_path = format!("{param}[{j}]");
                let Value::Object(map) = part else {
                    return Err(ApiError::invalid(
                        &part_path,
                        format!(
                            "{part_path}: expected a content part object, found {}",
                            shown(part)
                        ),
                    ));
                };
                let part_fields = Fields::nested(map, part_path.clone());
                match part_fields.string("type")? {
                    Some("text") => {}
                    Some(other) => {
                        let type_param = part_fields.param("type");
                        return Err(ApiError::unsupported(
                            &type_param,
                            format!("{type_param}: content parts of type {other:?} are not supported: expected \"text\""),
                        ));
                    }
                    None => {
                        let type_param = part_fields.param("type");
                        return Err(ApiError::invalid(
                            &type_param,
                            format!("{type_param}: expected \"text\", found nothing"),
                        ));
                    }
                }
                match part_fields.string("text")? {
                    Some(text) => texts.push(text),
                    None => {
                        let text_param = part_fields.param("text");
                        return Err(ApiError::invalid(
                            &text_param,
                            format!("{text_param}: expected a string, found nothing"),
                        ));
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(other) => Err(ApiError::invalid(
            &param,
            format!(
                "{param}: expected a string or a list of text parts, found {}",
                shown(other)
            ),
        )),
    }
}

/// Checks a text completion body.
pub fn parse_completion(body: &Value) -> Result<CompletionRequest, ApiError> {
    let fields = Fields::root(body)?;
    let common = common_params(&fields)?;
    match fields.get("suffix") {
        Some(Value::String(s)) if s.is_empty() => {}
        _ => fields.refuse("suffix", "fill-in-the-middle suffixes are not implemented")?,
    }
    if fields.bool("echo")? == Some(true) {
        return Err(ApiError::unsupported(
            "echo",
            "echo is not supported by ember: the prompt is not repeated in the output",
        ));
    }
    if let Some(best_of) = fields.integer("best_of", i64::MIN, i64::MAX)? {
        if best_of != 1 {
            return Err(ApiError::unsupported(
                "best_of",
                format!("best_of: only 1 is supported, found {best_of}"),
            ));
        }
    }
    let logprobs = fields
        .integer("logprobs", 0, MAX_TOP_LOGPROBS as i64)?
        .map(|n| n as usize);
    let prompt = parse_prompt(&fields)?;
    Ok(CompletionRequest {
        common,
        prompt,
        logprobs,
    })
}

fn token_ids(items: &[Value], path: &str) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match as_integer(item) {
            Some(id) if (0..=u32::MAX as i128).contains(&id) => Ok(id as u32),
            _ => {
                let param = format!("{path}[{i}]");
                Err(ApiError::invalid(
                    &param,
                    format!(
                        "{param}: expected a token id (an integer from 0), found {}",
                        shown(item)
                    ),
                ))
            }
        })
        .collect()
}

fn parse_prompt(fields: &Fields<'_>) -> Result<Prompt, ApiError> {
    let several = |n: usize| {
        ApiError::unsupported(
            "prompt",
            format!(
                "prompt: expected one prompt, found a list of {n}: send one request per prompt"
            ),
        )
    };
    match fields.get("prompt") {
        None => Err(ApiError::invalid(
            "prompt",
            "prompt: expected a string or a list of token ids, found nothing",
        )),
        Some(Value::String(text)) => Ok(Prompt::Text(text.clone())),
        Some(Value::Array(items)) => match items.first() {
            None => Err(ApiError::invalid(
                "prompt",
                "prompt: expected a string or a list of token ids, found an empty list",
            )),
            Some(Value::String(_)) => match items.as_slice() {
                [Value::String(text)] => Ok(Prompt::Text(text.clone())),
                _ => Err(several(items.len())),
            },
            Some(Value::Array(_)) => match items.as_slice() {
                [Value::Array(ids)] => Ok(Prompt::Tokens(token_ids(ids, "prompt[0]")?)),
                _ => Err(several(items.len())),
            },
            Some(_) => Ok(Prompt::Tokens(token_ids(items, "prompt")?)),
        },
        Some(other) => Err(fields.wrong_type("prompt", "a string or a list of token ids", other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(body: Value) -> Result<ChatRequest, (Option<String>, String)> {
        parse_chat(&body).map_err(|e| (e.param, e.message))
    }

    fn completion(body: Value) -> Result<CompletionRequest, (Option<String>, String)> {
        parse_completion(&body).map_err(|e| (e.param, e.message))
    }

    fn refused_param(result: Result<impl std::fmt::Debug, (Option<String>, String)>) -> String {
        result.unwrap_err().0.unwrap_or_default()
    }

    #[test]
    fn chat_defaults_are_llama_servers() {
        let request = chat(json!({"messages": [{"role": "user", "content": "hi"}]})).unwrap();
        let sampling = &request.common.sampling;
        assert_eq!(sampling.temperature, 0.8);
        assert_eq!(sampling.top_k, 40);
        assert_eq!(sampling.top_p, 0.95);
        assert_eq!(sampling.min_p, 0.05);
        assert_eq!(request.common.seed, None);
        assert_eq!(request.common.max_tokens, None);
        assert!(!request.common.stream);
        assert_eq!(request.logprobs, None);
        assert_eq!(request.messages[0].role, "user");
    }

    #[test]
    fn chat_fields_are_read() {
        let request = chat(json!({
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "ok", "name": "bot"},
                {"role": "user", "content": "again"}
            ],
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": -1,
            "min_p": 0.1,
            "seed": -1,
            "stop": ["\n", "END"],
            "presence_penalty": -2,
            "frequency_penalty": 1.5,
            "logprobs": true,
            "top_logprobs": 3,
            "n": 1,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "logit_bias": {},
            "ignore_eos": true,
            "return_token_ids": true,
            "some_future_field": {"x": 1}
        }))
        .unwrap();
        assert_eq!(request.common.model.as_deref(), Some("m"));
        assert!(request.common.stream && request.common.include_usage);
        assert_eq!(request.common.max_tokens, Some(7));
        assert_eq!(request.common.sampling.temperature, 0.0);
        assert_eq!(request.common.sampling.top_k, 0);
        assert_eq!(request.common.seed, Some(u64::MAX));
        assert_eq!(request.common.stop, vec!["\n", "END"]);
        assert_eq!(request.common.sampling.presence_penalty, -2.0);
        assert_eq!(request.logprobs, Some(3));
        assert!(request.common.ignore_eos && request.common.return_token_ids);
        let roles: Vec<&str> = request.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!(request.messages[1].content, "a\nb");
    }

    #[test]
    fn chat_refusals_name_the_field() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let cases: Vec<(Value, &str)> = vec![
            (json!({}), "messages"),
            (json!({"messages": []}), "messages"),
            (json!({"messages": "hi"}), "messages"),
            (
                json!({"messages": [{"role": "tool", "content": "x"}]}),
                "messages[0].role",
            ),
            (json!({"messages": [{"content": "x"}]}), "messages[0].role"),
            (
                json!({"messages": [{"role": "user"}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": 5}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
                "messages[0].content[0].type",
            ),
            (json!({"messages": user, "temperature": 2.5}), "temperature"),
            (json!({"messages": user, "temperature": -1}), "temperature"),
            (
                json!({"messages": user, "temperature": "hot"}),
                "temperature",
            ),
            (json!({"messages": user, "top_p": 1.5}), "top_p"),
            (json!({"messages": user, "top_k": -2}), "top_k"),
            (json!({"messages": user, "min_p": -0.1}), "min_p"),
            (json!({"messages": user, "max_tokens": 0}), "max_tokens"),
            (json!({"messages": user, "max_tokens": -5}), "max_tokens"),
            (json!({"messages": user, "max_tokens": 1e30}), "max_tokens"),
            (json!({"messages": user, "max_tokens": 2.5}), "max_tokens"),
            (
                json!({"messages": user, "max_completion_tokens": "10"}),
                "max_completion_tokens",
            ),
            (
                json!({"messages": user, "presence_penalty": 3}),
                "presence_penalty",
            ),
            (
                json!({"messages": user, "frequency_penalty": -2.5}),
                "frequency_penalty",
            ),
            (json!({"messages": user, "n": 2}), "n"),
            (
                json!({"messages": user, "stop": ["a", "b", "c", "d", "e"]}),
                "stop",
            ),
            (json!({"messages": user, "stop": [1]}), "stop[0]"),
            (json!({"messages": user, "stop": ""}), "stop"),
            (json!({"messages": user, "stream": "yes"}), "stream"),
            (json!({"messages": user, "top_logprobs": 2}), "top_logprobs"),
            (
                json!({"messages": user, "logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
            (
                json!({"messages": user, "tools": [{"type": "function"}]}),
                "tools",
            ),
            (
                json!({"messages": user, "tool_choice": "required"}),
                "tool_choice",
            ),
            (json!({"messages": user, "functions": [{}]}), "functions"),
            (
                json!({"messages": user, "function_call": "auto"}),
                "function_call",
            ),
            (
                json!({"messages": user, "response_format": {"type": "json_object"}}),
                "response_format.type",
            ),
            (
                json!({"messages": user, "logit_bias": {"50256": -100}}),
                "logit_bias",
            ),
            (json!({"messages": user, "audio": {"voice": "x"}}), "audio"),
            (
                json!({"messages": user, "modalities": ["text", "audio"]}),
                "modalities",
            ),
            (json!({"messages": user, "model": 7}), "model"),
            (json!({"messages": user, "seed": 1.5}), "seed"),
        ];
        for (body, param) in cases {
            let shown = body.to_string();
            assert_eq!(refused_param(chat(body)), param, "{shown}");
        }
    }

    #[test]
    fn refusal_messages_say_expected_and_found() {
        let (param, message) =
            chat(json!({"messages": [{"role": "user", "content": "x"}], "temperature": 9}))
                .unwrap_err();
        assert_eq!(param.as_deref(), Some("temperature"));
        assert_eq!(
            message,
            "temperature: expected a number from 0 to 2, found 9"
        );
        let error = parse_chat(&json!([1, 2])).unwrap_err();
        assert_eq!(
            error.message,
            "the request body is an array: expected a JSON object"
        );
    }

    #[test]
    fn completion_prompts() {
        let text = completion(json!({"prompt": "Once"})).unwrap();
        assert_eq!(text.prompt, Prompt::Text("Once".into()));
        let one = completion(json!({"prompt": ["Once"]})).unwrap();
        assert_eq!(one.prompt, Prompt::Text("Once".into()));
        let ids = completion(json!({"prompt": [1, 2, 3], "logprobs": 2})).unwrap();
        assert_eq!(ids.prompt, Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(ids.logprobs, Some(2));
        let nested = completion(json!({"prompt": [[4, 5]]})).unwrap();
        assert_eq!(nested.prompt, Prompt::Tokens(vec![4, 5]));
        let cases: Vec<(Value, &str)> = vec![
            (json!({}), "prompt"),
            (json!({"prompt": []}), "prompt"),
            (json!({"prompt": ["a", "b"]}), "prompt"),
            (json!({"prompt": [[1], [2]]}), "prompt"),
            (json!({"prompt": [1, -2]}), "prompt[1]"),
            (json!({"prompt": [1, "x"]}), "prompt[1]"),
            (json!({"prompt": [[1, 4_294_967_296_u64]]}), "prompt[0][1]"),
            (json!({"prompt": 5}), "prompt"),
            (json!({"prompt": "x", "echo": true}), "echo"),
            (json!({"prompt": "x", "suffix": "y"}), "suffix"),
            (json!({"prompt": "x", "best_of": 3}), "best_of"),
            (json!({"prompt": "x", "logprobs": 50}), "logprobs"),
            (json!({"prompt": "x", "logprobs": true}), "logprobs"),
        ];
        for (body, param) in cases {
            let shown = body.to_string();
            assert_eq!(refused_param(completion(body)), param, "{shown}");
        }
        assert!(
            completion(json!({"prompt": "x", "echo": false, "best_of": 1, "suffix": ""})).is_ok()
        );
    }

    #[test]
    fn into_generate_uses_the_given_seed_or_the_random_one() {
        let request =
            completion(json!({"prompt": "x", "seed": 7, "max_tokens": 3, "stop": "."})).unwrap();
        let generate = request.common.clone().into_generate(vec![1], None, 99);
        assert_eq!(generate.sampling.seed, 7);
        assert_eq!(generate.max_tokens, Some(3));
        assert_eq!(generate.stop, vec!["."]);
        let unseeded = completion(json!({"prompt": "x"})).unwrap();
        assert_eq!(
            unseeded
                .common
                .into_generate(vec![1], Some(2), 99)
                .sampling
                .seed,
            99
        );
    }
}
