//! AutoDeco (arXiv 2510.26697): heads on a frozen base model that predict, at every token, the
//! temperature and top-p to decode it with.
