//! Numbers read as C reads them (`std::stoull`, `std::stod`), as PyTorch's parser does.

#[derive(Debug, PartialEq)]
pub(crate) enum NumberError {
    /// No number at the start of the word (`std::invalid_argument`).
    Invalid,
    /// A number too large (or too small) to hold (`std::out_of_range`).
    OutOfRange,
}

/// `std::stoull`: optional sign, decimal digits; the rest of the word is left over. A minus
/// sign wraps (`-1` is `u64::MAX`), as `strtoull` does. Returns the value and where it stopped.
pub(crate) fn c_stoull(word: &str) -> std::result::Result<(u64, usize), NumberError> {
    let bytes = word.as_bytes();
    let mut i = 0;
    let negative = matches!(bytes.first(), Some(b'-'));
    if matches!(bytes.first(), Some(b'+' | b'-')) {
        i += 1;
    }
    let digits_start = i;
    let mut value: u64 = 0;
    let mut overflow = false;
    while let Some(digit) = bytes.get(i).filter(|b| b.is_ascii_digit()) {
        match value
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(digit - b'0')))
        {
            Some(v) => value = v,
            None => overflow = true,
        }
        i += 1;
    }
    if i == digits_start {
        return Err(NumberError::Invalid);
    }
    if overflow {
        return Err(NumberError::OutOfRange);
    }
    Ok((
        if negative {
            value.wrapping_neg()
        } else {
            value
        },
        i,
    ))
}

/// `std::stod`: optional sign, then `inf`/`infinity`/`nan`/`nan(...)` in any case, or a decimal
/// number with an optional exponent; the rest of the word is left over. Overflow and underflow
/// (to zero or to a subnormal) are out of range, as glibc's `strtod` reports them. Hexadecimal
/// floats (`0x1p-1`) are not read: they stop after the `0`.
pub(crate) fn c_stod(word: &str) -> std::result::Result<(f64, usize), NumberError> {
    let bytes = word.as_bytes();
    let mut i = 0;
    let negative = matches!(bytes.first(), Some(b'-'));
    if matches!(bytes.first(), Some(b'+' | b'-')) {
        i += 1;
    }
    let sign = if negative { -1.0 } else { 1.0 };
    let lower = word[i..].to_ascii_lowercase();
    if lower.starts_with("inf") {
        let len = if lower.starts_with("infinity") { 8 } else { 3 };
        return Ok((sign * f64::INFINITY, i + len));
    }
    if lower.starts_with("nan") {
        i += 3;
        // `nan(chars)` is one number when the parenthesis closes over letters, digits and `_`.
        if bytes.get(i) == Some(&b'(') {
            let inner = bytes[i + 1..]
                .iter()
                .take_while(|b| b.is_ascii_alphanumeric() || **b == b'_')
                .count();
            if bytes.get(i + 1 + inner) == Some(&b')') {
                i += inner + 2;
            }
        }
        return Ok((f64::NAN, i));
    }
    let mantissa_start = i;
    let mut digits = 0;
    let mut nonzero = false;
    while let Some(b) = bytes.get(i).filter(|b| b.is_ascii_digit()) {
        nonzero |= *b != b'0';
        digits += 1;
        i += 1;
    }
    if bytes.get(i) == Some(&b'.') {
        i += 1;
        while let Some(b) = bytes.get(i).filter(|b| b.is_ascii_digit()) {
            nonzero |= *b != b'0';
            digits += 1;
            i += 1;
        }
    }
    if digits == 0 {
        return Err(NumberError::Invalid);
    }
    // An exponent counts only when digits follow the `e` (and its sign).
    if matches!(bytes.get(i), Some(b'e' | b'E')) {
        let mut j = i + 1;
        if matches!(bytes.get(j), Some(b'+' | b'-')) {
            j += 1;
        }
        if bytes.get(j).is_some_and(u8::is_ascii_digit) {
            while bytes.get(j).is_some_and(u8::is_ascii_digit) {
                j += 1;
            }
            i = j;
        }
    }
    let magnitude: f64 = word[mantissa_start..i]
        .parse()
        .map_err(|_| NumberError::Invalid)?;
    if magnitude.is_infinite() || (nonzero && magnitude < f64::MIN_POSITIVE) {
        return Err(NumberError::OutOfRange);
    }
    Ok((sign * magnitude, i))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::{KMB, err, ok};

    #[test]
    fn numbers_are_read_like_stoull() {
        assert_eq!(c_stoull("40"), Ok((40, 2)));
        assert_eq!(c_stoull("40MB"), Ok((40, 2)));
        assert_eq!(c_stoull("-1"), Ok((u64::MAX, 2)));
        assert_eq!(c_stoull("-0"), Ok((0, 2)));
        assert_eq!(c_stoull("0x10"), Ok((0, 1)));
        assert_eq!(c_stoull("abc"), Err(NumberError::Invalid));
        assert_eq!(c_stoull("-"), Err(NumberError::Invalid));
        assert_eq!(c_stoull(""), Err(NumberError::Invalid));
        assert_eq!(
            c_stoull("18446744073709551616"),
            Err(NumberError::OutOfRange)
        );
    }

    #[test]
    fn numbers_are_read_like_stod() {
        assert_eq!(c_stod("0.5"), Ok((0.5, 3)));
        assert_eq!(c_stod(".5x"), Ok((0.5, 2)));
        assert_eq!(c_stod("5."), Ok((5.0, 2)));
        assert_eq!(c_stod("1e-1"), Ok((0.1, 4)));
        assert_eq!(c_stod("1e"), Ok((1.0, 1)));
        assert_eq!(c_stod("-2E+1"), Ok((-20.0, 5)));
        assert_eq!(c_stod("InFiNiTy"), Ok((f64::INFINITY, 8)));
        assert_eq!(c_stod("-inf"), Ok((f64::NEG_INFINITY, 4)));
        assert!(c_stod("nan(x1)").is_ok_and(|(v, end)| v.is_nan() && end == 7));
        assert!(c_stod("nan(").is_ok_and(|(v, end)| v.is_nan() && end == 3));
        assert_eq!(c_stod("."), Err(NumberError::Invalid));
        assert_eq!(c_stod("e5"), Err(NumberError::Invalid));
        assert_eq!(c_stod("1e999"), Err(NumberError::OutOfRange));
        assert_eq!(c_stod("1e-400"), Err(NumberError::OutOfRange));
        assert_eq!(c_stod("0e-400"), Ok((0.0, 6)));
    }

    #[test]
    fn a_word_that_is_not_a_number_names_the_key() {
        assert_eq!(
            err("max_split_size_mb:abc"),
            "Invalid value 'abc' for max_split_size_mb: expected an unsigned integer \
             (PyTorch fails with std::invalid_argument: stoull)"
        );
        assert_eq!(
            err("garbage_collection_threshold:half"),
            "Invalid value 'half' for garbage_collection_threshold: expected a number \
             (PyTorch fails with std::invalid_argument: stod)"
        );
        assert_eq!(
            err("max_split_size_mb:99999999999999999999"),
            "Value '99999999999999999999' for max_split_size_mb is out of range \
             (PyTorch fails with std::out_of_range: stoull)"
        );
        assert_eq!(
            err("per_process_memory_fraction:1e999"),
            "Value '1e999' for per_process_memory_fraction is out of range \
             (PyTorch fails with std::out_of_range: stod)"
        );
    }

    #[test]
    fn leading_numbers_and_negative_numbers_are_taken_with_a_warning() {
        let c = ok("max_split_size_mb:40MB");
        assert_eq!(c.max_split_size, 40 * KMB);
        assert_eq!(
            c.provenance.warnings,
            [
                "max_split_size_mb: 'MB' after the number in '40MB' is ignored, as PyTorch reads \
              only the leading number"
            ]
        );
        let c = ok("max_split_size_mb:-1");
        assert_eq!(c.max_split_size, usize::MAX / KMB * KMB);
        assert_eq!(
            c.provenance.warnings,
            [
                "max_split_size_mb: '-1' is read as 18446744073709551615, as PyTorch's stoull \
              wraps negative numbers"
            ]
        );
    }

    #[test]
    fn a_missing_value_is_out_of_bounds() {
        let message = "Index out of bounds in ConfigTokenizer (the value of max_split_size_mb is \
                       missing or incomplete)";
        assert_eq!(err("max_split_size_mb"), message);
        assert_eq!(err("max_split_size_mb:"), message);
        assert_eq!(
            err("expandable_segments:"),
            "Index out of bounds in ConfigTokenizer (the value of expandable_segments is \
             missing or incomplete)"
        );
    }
}
