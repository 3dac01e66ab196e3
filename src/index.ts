// The package `outboxd`: the library an application embeds. `outboxd worker` and the rest of the CLI
// come with it (package.json bin).
export { Outboxd, type CancelRequest, type CaptureRequest, type ChargeRequest, type EffectRequest, type OutboxdOptions, type PaymentOperation, type RefundRequest, type SettledOptions, type SettlementHandler, type TransactionalSettlementHandler } from './outboxd.ts';
export { EffectFailed, type CheckResult, type EffectContext, type EffectDefinition } from './kinds/application/definition.ts';
export { EffectConflictError, type EffectRequested } from './kinds/application/request.ts';
export type { Policy } from './engine/kinds.ts';
export type { EffectWorker } from './runtime/inProcess.ts';
export type { SettlementEvent, SettlementTransaction } from './outbox/settlements.ts';
export type { SettlementSource } from './engine/operation.ts';
export type { ChargeRequested } from './kinds/charge/request.ts';
export type { OperationStatus } from './engine/operation.ts';
export { OrderConflictError } from './kinds/charge/request.ts';
export { RefundRefused, type RefundRequested } from './kinds/refund/request.ts';
export { AuthorizationRefused, type ChangeRequested } from './kinds/hold/request.ts';
export type { CancellationReason, RefundReason } from './stripe/gateway.ts';
export { OperationNotFoundError } from './engine/operation.ts';
export { ValidationError } from './types/errors.ts';
export { TransactionTypeError } from './db/caller.ts';
export { ConfigError } from './runtime/config.ts';
