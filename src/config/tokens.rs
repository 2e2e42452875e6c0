//! PyTorch's `ConfigTokenizer`: a setting cut into words and separators.

use super::{ConfigError, Result};

/// PyTorch's `ConfigTokenizer`: the words and separators of a setting.
pub(crate) struct Tokens(pub(crate) Vec<String>);

impl Tokens {
    /// `,` `:` `[` `]` are tokens of their own; white space (C's `isspace`) is dropped, also
    /// inside words. Older PyTorch dropped only spaces.
    pub(crate) fn new(text: &str) -> Tokens {
        let mut tokens = Vec::new();
        let mut word = String::new();
        for ch in text.chars() {
            if matches!(ch, ',' | ':' | '[' | ']') {
                if !word.is_empty() {
                    tokens.push(std::mem::take(&mut word));
                }
                tokens.push(ch.to_string());
            } else if !is_c_space(ch) {
                word.push(ch);
            }
        }
        if !word.is_empty() {
            tokens.push(word);
        }
        Tokens(tokens)
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// `operator[]`/`checkIndex`: PyTorch fails an internal assertion past the end. The message
    /// keeps PyTorch's words and names the setting that ended too early.
    pub(crate) fn get(&self, i: usize, key: &str) -> Result<&str> {
        self.0.get(i).map(String::as_str).ok_or_else(|| {
            ConfigError::new(format!(
                "Index out of bounds in ConfigTokenizer (the value of {key} is missing or \
                 incomplete)"
            ))
        })
    }

    /// `checkToken` used as a question: is token `i` `expected`? Past the end is an error.
    pub(crate) fn is(&self, i: usize, expected: &str, key: &str) -> Result<bool> {
        Ok(self.get(i, key)? == expected)
    }
}

/// C's `isspace` in the "C" locale.
fn is_c_space(ch: char) -> bool {
    matches!(ch, ' ' | '\t' | '\n' | '\u{0b}' | '\u{0c}' | '\r')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::config::test_support::{KMB, ok};

    #[test]
    fn tokens_split_on_separators_and_drop_white_space() {
        let tokens = Tokens::new(" max split_size_mb :\t40,\nx:[1:2]");
        assert_eq!(
            tokens.0,
            [
                "maxsplit_size_mb",
                ":",
                "40",
                ",",
                "x",
                ":",
                "[",
                "1",
                ":",
                "2",
                "]"
            ]
        );
    }

    #[test]
    fn empty_or_blank_setting_is_the_defaults() {
        assert_eq!(ok(""), Config::default());
        assert_eq!(ok("  \t "), Config::default());
    }

    #[test]
    fn spaces_anywhere_are_dropped() {
        let c = ok(" max_split_size_mb : 4 0 , expandable_segments : Tr ue ");
        assert_eq!(c.max_split_size, 40 * KMB);
        assert!(c.expandable_segments);
    }
}
