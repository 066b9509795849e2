//! The text side of an install: tokenizer, chat template, family, and what the generation loop
//! derives from them once (stop ids, the assistant-turn opener, the tool-call marker).

use std::path::Path;
use std::sync::OnceLock;

use mference_text::{stop_token_ids, ChatTemplate, Family, TextError, Tokenizer, TokenizerCache};
use serde_json::Value;

use crate::constraint::Grammars;
use crate::SessionError;

/// The text side of an install, shared by the prompt side (rendering, tokenizing: the HTTP
/// handlers, `run`'s argument checks) and the generation loop (detokenizing, stops, tool calls,
/// constraints). `Send + Sync`: the server holds it in an `Arc`.
pub struct TextSide {
    /// The install's tokenizer.
    pub tokenizer: Tokenizer,
    /// The install's chat template; `None` means only raw prompts (`/v1/completions`, `--prompt`).
    pub template: Option<ChatTemplate>,
    /// The family (stop tokens, template variables, tool-call syntax).
    pub family: Family,
    /// `max_position_embeddings` of the model's config (Inkling: `model_max_length`), if stated.
    pub max_positions: Option<usize>,
    /// The ids that end generation ([`stop_token_ids`]).
    pub stop_ids: Vec<u32>,
    /// The family's assistant-turn opener ([`Family::turn_open_token`]) as one id, if it is one.
    pub turn_open: Option<u32>,
    /// The family's tool-call marker token ([`tool_marker_token`]) as one id: a call carries
    /// this token; the same characters spelled by other tokens are prose.
    pub tool_marker_id: Option<u32>,
    /// What [`TextSide::load`] did with the install's tokenizer cache
    /// ([`mference_format::TOKENIZER_CACHE_FILE`]); `None` for a text side made by
    /// [`TextSide::new`].
    pub tokenizer_cache: Option<TokenizerCache>,
    /// The grammar compiler, built on the first constrained request (it indexes the vocabulary).
    pub(crate) grammars: OnceLock<Result<Grammars, String>>,
}

/// `max_position_embeddings` of a config.json (its `text_config` for multimodal configs).
fn max_positions_of(config: &Value) -> Option<usize> {
    let text_cfg = config.get("text_config").unwrap_or(config);
    // Inkling states its limit as `model_max_length` only.
    ["max_position_embeddings", "model_max_length"]
        .iter()
        .find_map(|k| text_cfg.get(*k).and_then(|v| v.as_u64()))
        .map(|v| v as usize)
}

/// The install's `max_position_embeddings`, when its `tokenizer/config.json` states one.
///
/// Errors: [`SessionError::Install`] when that file cannot be read or is not JSON.
pub fn max_positions(install: &Path) -> Result<Option<usize>, SessionError> {
    let path = install.join("tokenizer/config.json");
    let bytes = std::fs::read(&path)
        .map_err(|e| SessionError::Install(format!("reading {}: {e}", path.display())))?;
    let config: Value = serde_json::from_slice(&bytes)
        .map_err(|e| SessionError::Install(format!("{} is not valid JSON: {e}", path.display())))?;
    Ok(max_positions_of(&config))
}

/// Refuses a directory that is not a complete install (a checkpoint, an unfinished install,
/// anything else) with what to run instead ([`SessionError::Install`]).
pub fn check_install_dir(dir: &Path) -> Result<(), SessionError> {
    if !dir.join("manifest.json").is_file() {
        let d = dir.display();
        let msg = if dir.join("config.json").is_file() {
            format!("{d} is a checkpoint, not an install: run `mference install {d} --output NAME.gturbo` first")
        } else if dir.as_os_str().to_string_lossy().ends_with(".partial")
            || dir.with_extension("gturbo.partial").exists()
        {
            format!("{d} is an unfinished install: finish it with `mference install ... --resume` or remove it with `mference discard`")
        } else {
            format!("{d} is not an mference install (no manifest.json): create one with `mference install <checkpoint> --output NAME.gturbo`")
        };
        return Err(SessionError::Install(msg));
    }
    Ok(())
}

/// The tool-call opening marker of `family`: text from it on is held back while streaming.
pub fn tool_marker(family: Family) -> &'static str {
    match family {
        Family::Gemma4 => "<|tool_call>",
        Family::Qwen3_5Moe | Family::Maple => "<tool_call>",
        Family::DeepseekV4 => "<｜DSML｜tool_calls>",
        // Inkling's tool-invocation content marker; its text template renders no tools, and the
        // family's parser returns any such text as content.
        Family::Inkling => "<|content_invoke_tool_json|>",
    }
}

/// The one token whose presence in the generated ids makes text at [`tool_marker`] a call
/// rather than prose: the marker itself where it is one token; DeepSeek-V4's
/// `<｜DSML｜tool_calls>` is `<`, the added token `｜DSML｜` (128825) and `tool_calls>`, so there it
/// is `｜DSML｜`, which every DSML tag the model writes carries.
pub fn tool_marker_token(family: Family) -> &'static str {
    match family {
        Family::DeepseekV4 => "｜DSML｜",
        f => tool_marker(f),
    }
}

impl TextSide {
    /// Loads `<install>/tokenizer/` (tokenizer, template and `config.json`'s `model_type` and
    /// position limit). The tokenizer comes from the install's tokenizer cache when that was
    /// made from this `tokenizer.json`, else from `tokenizer.json`, and the cache is then
    /// (re)written ([`Tokenizer::from_dir_cached`]; the outcome is in `tokenizer_cache`).
    ///
    /// Errors: [`SessionError::Text`] for the tokenizer or a template that does not compile,
    /// [`SessionError::Install`] for a missing `config.json` or an unknown `model_type`.
    pub fn load(install: &Path) -> Result<Self, SessionError> {
        let dir = install.join("tokenizer");
        let (tokenizer, cache) =
            Tokenizer::from_dir_cached(&dir, &install.join(mference_format::TOKENIZER_CACHE_FILE))?;
        let template = match ChatTemplate::from_dir(&dir) {
            Ok(t) => Some(t),
            Err(TextError::NoChatTemplate(_)) => None,
            Err(e) => return Err(e.into()),
        };
        let config = std::fs::read(dir.join("config.json")).map_err(|e| {
            SessionError::Install(format!(
                "{} is not an install (cannot read tokenizer/config.json: {e})",
                install.display()
            ))
        })?;
        let config: Value = serde_json::from_slice(&config).map_err(|e| {
            SessionError::Install(format!("tokenizer/config.json is not valid JSON: {e}"))
        })?;
        let mt = config
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        let family = Family::from_model_type(mt)
            .ok_or_else(|| SessionError::Install(format!("unknown model_type '{mt}'")))?;
        let mut text = Self::new(tokenizer, template, family, max_positions_of(&config));
        text.tokenizer_cache = Some(cache);
        Ok(text)
    }

    /// A text side from its parts (the stop ids and markers are looked up in `tokenizer`).
    pub fn new(
        tokenizer: Tokenizer,
        template: Option<ChatTemplate>,
        family: Family,
        max_positions: Option<usize>,
    ) -> Self {
        let one_id = |s: &str| match tokenizer.encode(s, false) {
            Ok(ids) if ids.len() == 1 => Some(ids[0]),
            _ => None,
        };
        let turn_open = one_id(family.turn_open_token());
        let tool_marker_id = one_id(tool_marker_token(family));
        Self {
            stop_ids: stop_token_ids(family, &tokenizer),
            turn_open,
            tool_marker_id,
            tokenizer,
            template,
            family,
            max_positions,
            tokenizer_cache: None,
            grammars: OnceLock::new(),
        }
    }

    /// Renders `messages` (`{role, content, …}` objects ready for the template) with `tools`
    /// through the chat template with the generation prompt and the family's template variables
    /// (thinking off), and tokenizes the result (the template writes BOS itself).
    ///
    /// Errors: [`SessionError::NoTemplate`]; [`SessionError::Text`] when the template rejects
    /// the conversation or the text does not tokenize.
    pub fn render_chat(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
    ) -> Result<Vec<u32>, SessionError> {
        let t = self.template.as_ref().ok_or(SessionError::NoTemplate)?;
        let s = t.render(
            messages,
            tools,
            true,
            &self.family.default_template_kwargs(),
        )?;
        Ok(self.tokenizer.encode(&s, false)?)
    }

    /// The text and bytes of one token for logprobs: its decoded text, except that a
    /// byte-fallback token (`<0xE2>`) reports its raw byte (its text alone is not valid UTF-8).
    pub fn token_text(&self, id: u32) -> (String, Vec<u8>) {
        let s = self.tokenizer.decode(&[id], false).unwrap_or_default();
        if let Some(piece) = self.tokenizer.id_to_token(id) {
            if let Some(hex) = piece.strip_prefix("<0x").and_then(|p| p.strip_suffix('>')) {
                if let Ok(b) = u8::from_str_radix(hex, 16) {
                    return (s, vec![b]);
                }
            }
        }
        let bytes = s.as_bytes().to_vec();
        (s, bytes)
    }
}
