//! The bytes each token id stands for, as a constrained decoder needs them (a grammar matches
//! bytes, not token strings).

use tokenizers::DecoderWrapper;

use crate::{TextError, Tokenizer};

/// What one token id writes into the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenBytes {
    /// These bytes (possibly an incomplete UTF-8 sequence: a byte-fallback `<0xE2>` is one byte).
    Text(Vec<u8>),
    /// A control token (`<eos>`, `<|turn>`, `<|tool_call>`, `<|im_end|>`), named by its string: it
    /// never stands for text a grammar could match.
    Special(String),
}

/// How the vocabulary's token strings spell bytes, from the decoder of `tokenizer.json`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Spelling {
    /// GPT-2 byte level (Qwen, DeepSeek): each character stands for one byte.
    ByteLevel,
    /// SentencePiece style (Gemma): `▁` is a space, `<0xHH>` is the byte HH, the rest is UTF-8.
    ByteFallback,
}

fn spelling(d: &DecoderWrapper) -> Option<Spelling> {
    match d {
        DecoderWrapper::ByteLevel(_) => Some(Spelling::ByteLevel),
        DecoderWrapper::ByteFallback(_) | DecoderWrapper::Metaspace(_) => {
            Some(Spelling::ByteFallback)
        }
        DecoderWrapper::Sequence(s) => s.get_decoders().iter().find_map(spelling),
        _ => None,
    }
}

/// The GPT-2 byte-level alphabet (Radford et al. 2019, `bytes_to_unicode` of the GPT-2 encoder):
/// printable Latin-1 bytes stand for themselves; the other 68 bytes, in order, for U+0100….
fn byte_level_alphabet() -> std::collections::HashMap<char, u8> {
    let printable =
        |b: u8| matches!(b, b'!'..=b'~') || matches!(b, 0xA1..=0xAC) || matches!(b, 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b as char, b)
            } else {
                let c = char::from_u32(next).expect("U+0100..U+0143 are chars");
                next += 1;
                (c, b)
            }
        })
        .collect()
}

impl Tokenizer {
    /// The bytes of every id `0..vocab_size()`, in id order. Added tokens that are marked
    /// `special`, or written `<…>` (Gemma's `<|tool_call>` is an added token that is not marked
    /// special), are [`TokenBytes::Special`]; other added tokens are their content's bytes.
    ///
    /// Errors: [`TextError::Tokenize`] when the decoder is neither byte level nor byte fallback
    /// (the bytes of such a vocabulary are not known), or an id has no token string.
    pub fn token_bytes(&self) -> Result<Vec<TokenBytes>, TextError> {
        let spelling = self.inner.get_decoder().and_then(spelling).ok_or_else(|| {
            TextError::Tokenize(
                "the tokenizer's decoder is neither ByteLevel nor ByteFallback, so the bytes of its tokens are not known".into(),
            )
        })?;
        let added = self.inner.get_added_tokens_decoder();
        let alphabet = byte_level_alphabet();
        (0..self.vocab_size() as u32)
            .map(|id| {
                if let Some(a) = added.get(&id) {
                    let c = &a.content;
                    return Ok(if a.special || (c.starts_with('<') && c.ends_with('>')) {
                        TokenBytes::Special(c.clone())
                    } else if spelling == Spelling::ByteFallback {
                        // The decoder's `▁` → space applies to added tokens too (Gemma's runs
                        // of `▁`).
                        TokenBytes::Text(c.replace('\u{2581}', " ").into_bytes())
                    } else {
                        TokenBytes::Text(c.as_bytes().to_vec())
                    });
                }
                let piece = self.inner.id_to_token(id).ok_or_else(|| {
                    TextError::Tokenize(format!("token id {id} has no token string"))
                })?;
                Ok(TokenBytes::Text(match spelling {
                    Spelling::ByteLevel => piece
                        .chars()
                        .map(|c| alphabet.get(&c).copied())
                        .collect::<Option<Vec<u8>>>()
                        .ok_or_else(|| {
                            TextError::Tokenize(format!(
                                "token {id} ({piece:?}) has a character outside the byte-level alphabet"
                            ))
                        })?,
                    Spelling::ByteFallback => match byte_fallback(&piece) {
                        Some(b) => vec![b],
                        None => piece.replace('\u{2581}', " ").into_bytes(),
                    },
                }))
            })
            .collect()
    }
}

/// `<0xHH>` → the byte HH.
fn byte_fallback(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2)
        .then(|| u8::from_str_radix(hex, 16).ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_is_a_bijection_with_gpt2s_space() {
        let a = byte_level_alphabet();
        assert_eq!(a.len(), 256);
        // GPT-2 writes a space as `Ġ` (U+0120) and a newline as `Ċ` (U+010A).
        assert_eq!(a[&'\u{0120}'], b' ');
        assert_eq!(a[&'\u{010A}'], b'\n');
        assert_eq!(a[&'A'], b'A');
        let mut bytes: Vec<u8> = a.values().copied().collect();
        bytes.sort_unstable();
        bytes.dedup();
        assert_eq!(bytes.len(), 256);
    }

    #[test]
    fn byte_fallback_pieces() {
        assert_eq!(byte_fallback("<0xE2>"), Some(0xE2));
        assert_eq!(byte_fallback("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_fallback("<0xZZ>"), None);
        assert_eq!(byte_fallback("<0x1>"), None);
        assert_eq!(byte_fallback("hello"), None);
    }
}
