//! The text side of an install: tokenizer, chat template, family, and what the generation loop
//! derives from them once (stop ids, the assistant-turn opener, the tool-call marker).

use std::path::Path;
use std::sync::OnceLock;

use mference_text::{
    stop_token_ids, ChatTemplate, Family, ReasoningParser, TextError, Tokenizer, TokenizerCache,
};
use serde_json::{Map, Value};

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

/// A chat rendered for generation ([`TextSide::render_chat`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatPrompt {
    /// The prompt's token ids.
    pub ids: Vec<u32>,
    /// The generation prompt ends inside the family's reasoning block (Qwen 3.6 with thinking
    /// on, Maple always): the reply starts with reasoning
    /// ([`Reasoning::Split`](crate::Reasoning::Split)).
    pub reasoning_open: bool,
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

/// Every id the tokenizer can produce must have an embedding row: an install made from a
/// checkpoint with a foreign tokenizer (a 1,024-id fixture with a full tokenizer) would otherwise
/// load and then fail every request. The installer refuses such a checkpoint; this catches
/// installs made before it did. Nothing to check when `config.json` states no vocabulary.
///
/// Errors: [`SessionError::Install`] naming both sizes.
fn check_vocab(tokenizer: &Tokenizer, config: &Value) -> Result<(), SessionError> {
    let Ok(arch) = mference_format::ArchInfo::from_config(config) else {
        return Ok(());
    };
    let ids = tokenizer.vocab_size() as u64;
    if ids > arch.vocab_size {
        return Err(SessionError::Install(format!(
            "tokenizer/tokenizer.json has {ids} token ids but the model's vocabulary \
             (config.json vocab_size, the embedding rows) is {}: ids from {} up would index past \
             the embedding. Reinstall from a checkpoint whose tokenizer belongs to it",
            arch.vocab_size, arch.vocab_size
        )));
    }
    Ok(())
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

/// The manifest's SHA-256 of `tokenizer/tokenizer.json` in `install` (`None` when it lists none).
fn tokenizer_json_digest(install: &Path) -> Result<Option<String>, SessionError> {
    let at = install.join(mference_format::MANIFEST_FILE);
    let bytes = std::fs::read(&at)
        .map_err(|e| SessionError::Install(format!("{} cannot be read: {e}", at.display())))?;
    let m = mference_format::Manifest::parse(&bytes)
        .map_err(|e| SessionError::Install(e.to_string()))?;
    Ok(m.files
        .get(&format!(
            "{}/tokenizer.json",
            mference_format::TOKENIZER_DIR
        ))
        .map(|f| f.sha256.clone()))
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
        Self::load_with(install, false)
    }

    /// [`TextSide::load`] for a caller that opens the same install with the full SHA-256 check
    /// ([`mference_format::VerifyPolicy::FullSha256`]) beside it and stops if that fails: the
    /// tokenizer cache is bound to the manifest's digest of `tokenizer.json` (which that check
    /// holds the file to) instead of a second hash of its ~33 MB here. Errors: those of
    /// [`TextSide::load`], and [`SessionError::Install`] for a manifest that cannot be read.
    pub fn load_beside_check(install: &Path) -> Result<Self, SessionError> {
        Self::load_with(install, true)
    }

    fn load_with(install: &Path, manifest_digest: bool) -> Result<Self, SessionError> {
        let dir = install.join("tokenizer");
        let digest = match manifest_digest {
            true => tokenizer_json_digest(install)?,
            false => None,
        };
        let (tokenizer, cache) = Tokenizer::from_dir_cached(
            &dir,
            &install.join(mference_format::TOKENIZER_CACHE_FILE),
            digest.as_deref(),
        )?;
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
        let family =
            Family::from_config(&config).map_err(|e| SessionError::Install(e.to_string()))?;
        check_vocab(&tokenizer, &config)?;
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
    /// through the chat template with the generation prompt, and tokenizes the result (the
    /// template writes BOS itself). The template variables are the family's defaults (thinking
    /// off: [`Family::default_template_kwargs`]) overridden by `kwargs` (`chat_template_kwargs`
    /// such as `enable_thinking`, `reasoning_effort`), as vLLM and llama-server pass them.
    ///
    /// Errors: [`SessionError::NoTemplate`]; [`SessionError::Text`] when a key of `kwargs` is
    /// one the template never reads ([`TextError::TemplateVariable`]: it would change nothing)
    /// or a render argument, when the template rejects the conversation, or when the text does
    /// not tokenize.
    pub fn render_chat(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        kwargs: &Map<String, Value>,
    ) -> Result<ChatPrompt, SessionError> {
        let t = self.template.as_ref().ok_or(SessionError::NoTemplate)?;
        t.check_extra(kwargs)?;
        let mut vars = self.family.default_template_kwargs();
        vars.extend(kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
        let s = t.render(messages, tools, true, &vars)?;
        Ok(ChatPrompt {
            ids: self.tokenizer.encode(&s, false)?,
            reasoning_open: ReasoningParser::prompt_leaves_open(self.family, &s),
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An install's `tokenizer/` holding a fixture's config (1,024 ids) and a full tokenizer.
    #[test]
    fn a_tokenizer_larger_than_the_vocabulary_is_refused_at_load_naming_both_sizes() {
        let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets");
        let install = std::env::temp_dir().join(format!("session-vocab-{}", std::process::id()));
        let dir = install.join("tokenizer");
        std::fs::create_dir_all(&dir).unwrap();
        let tok = assets.join("tokenizers/deepseek_v4");
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(tok.join(f), dir.join(f)).unwrap();
        }
        let cfg = assets.join("fixtures/deepseek_v4/A/checkpoint/config.json");
        std::fs::copy(cfg, dir.join("config.json")).unwrap();
        let err = TextSide::load(&install).err().map(|e| e.to_string());
        let ids = Tokenizer::from_dir(&dir).unwrap().vocab_size();
        std::fs::remove_dir_all(&install).unwrap();
        let msg = err.expect("the install loaded");
        assert!(
            msg.contains(&format!("has {ids} token ids")) && msg.contains("is 1024"),
            "{msg}"
        );
    }
}
