//! What a thread sets for its own allocations, as PyTorch keeps its per-thread context: the tag
//! they are made under (`ferrocache.region`) and the metadata their trace entries carry
//! (`torch.cuda.memory._set_memory_metadata`).
//!
//! A tag has one form past the C ABI: its id, the number the core takes. Names are interned
//! once, here, and a list of names becomes a list of ids.
//!
//! Until some thread sets either, an allocation reads no thread-local at all (one load of a
//! flag that is never written again): in a library loaded with `dlopen`, each thread-local
//! access is a call into the dynamic loader.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int};
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::guard::reporting_errors;
use super::registry::with_last_error;
use super::strings::{into_c_string, text_argument};
use crate::allocator::history::StackId;
use crate::allocator::uncached::Caller;

/// A tag's id: its index among the names interned, plus one.
pub(crate) type TagId = u32;

/// Set once any thread has set a tag or metadata; never cleared.
static IN_USE: AtomicBool = AtomicBool::new(false);

/// One thread's context.
struct ThreadContext {
    tag: Cell<Option<TagId>>,
    /// `None` when empty.
    metadata: RefCell<Option<Arc<str>>>,
}

thread_local! {
    static CONTEXT: ThreadContext = const {
        ThreadContext {
            tag: Cell::new(None),
            metadata: RefCell::new(None),
        }
    };
}

/// Whether some thread has set a tag or metadata: until then, every thread's are empty and
/// [`caller`] need not be asked (one load of a flag that is never written again).
#[inline(always)]
pub(crate) fn context_in_use() -> bool {
    IN_USE.load(Ordering::Relaxed)
}

/// The caller of an allocation or free on this thread: `stack` and this thread's tag, and its
/// metadata (`None`: none). A thread being torn down has neither.
#[inline(always)]
pub(crate) fn caller(stack: StackId) -> (Caller, Option<Arc<str>>) {
    if !IN_USE.load(Ordering::Relaxed) {
        return (Caller { stack, tag: None }, None);
    }
    context_of_this_thread(stack)
}

#[cold]
#[inline(never)]
fn context_of_this_thread(stack: StackId) -> (Caller, Option<Arc<str>>) {
    CONTEXT
        .try_with(|context| {
            let caller = Caller {
                stack,
                tag: context.tag.get(),
            };
            (caller, context.metadata.borrow().clone())
        })
        .unwrap_or((Caller { stack, tag: None }, None))
}

/// Interned tag names, with their ids.
#[derive(Default)]
struct TagNames {
    ids: FxHashMap<String, TagId>,
}

static TAG_NAMES: Mutex<Option<TagNames>> = Mutex::new(None);

/// The id of the tag `name`, interned on first use.
fn tag_id(name: &str) -> TagId {
    let mut names = TAG_NAMES.lock();
    let names = names.get_or_insert_with(TagNames::default);
    if let Some(&id) = names.ids.get(name) {
        return id;
    }
    let id = TagId::try_from(names.ids.len() + 1).unwrap_or(TagId::MAX);
    names.ids.insert(name.to_owned(), id);
    id
}

/// The ids of the tags in `names` (separated by newlines). Unknown names are interned: they
/// hold nothing.
pub(crate) fn tag_ids(names: &str) -> Vec<TagId> {
    names
        .lines()
        .filter(|n| !n.is_empty())
        .map(tag_id)
        .collect()
}

/// Makes this thread's allocations from now on go under tag `tag` (NULL: no tag), on every
/// device. The first tag makes every device's new segments sleep-able. Returns 0, or -1 (last
/// error set).
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_set_thread_tag(tag: *const c_char) -> c_int {
    with_last_error("ferrocache_set_thread_tag", -1, || {
        let id = if tag.is_null() {
            None
        } else {
            // SAFETY: non-NULL, and the caller promises a NUL-terminated string.
            let name = unsafe { text_argument(tag, "the tag") }?;
            if name.is_empty() {
                return Err("a tag must not be empty".to_string());
            }
            Some(tag_id(name))
        };
        IN_USE.store(true, Ordering::Relaxed);
        CONTEXT.with(|context| context.tag.set(id));
        Ok(0)
    })
}

/// `torch.cuda.memory._set_memory_metadata(text)`: the trace entries that this thread's
/// allocations and frees record from now on carry `text` as `user_metadata`; an empty `text`
/// clears it. Returns 0, or -1 (last error set) for a NULL or non-UTF-8 `text`.
///
/// # Safety
/// `text` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_set_memory_metadata(text: *const c_char) -> c_int {
    reporting_errors("ferrocache_set_memory_metadata", -1, || {
        // SAFETY: passed on from our caller, who promises the same.
        let text = unsafe { text_argument(text, "the metadata") }?;
        let metadata = (!text.is_empty()).then(|| Arc::<str>::from(text));
        IN_USE.store(true, Ordering::Relaxed);
        CONTEXT.with(|context| *context.metadata.borrow_mut() = metadata);
        Ok(0)
    })
}

/// `torch.cuda.memory._get_memory_metadata()`: this thread's metadata ("" when none). Returns
/// a string to free with `ferrocache_string_free`.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_get_memory_metadata() -> *mut c_char {
    reporting_errors("ferrocache_get_memory_metadata", ptr::null_mut(), || {
        let text = CONTEXT.with(|context| {
            context
                .metadata
                .borrow()
                .as_deref()
                .unwrap_or("")
                .to_string()
        });
        Ok(into_c_string(text))
    })
}
