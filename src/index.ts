// The package `outboxd`: the library an application embeds. `outboxd worker` and the rest of the CLI
// come with it (package.json bin).
export { Outboxd, type ChargeRequest, type EffectRequest, type OutboxdOptions, type PaymentOperation, type RefundRequest, type SettledOptions, type SettlementHandler, type TransactionalSettlementHandler } from './outboxd.ts';
export { EffectFailed, type CheckResult, type EffectContext, type EffectDefinition } from './effects/application.ts';
export { EffectConflictError, type EffectRequested } from './effects/request.ts';
export type { Policy } from './effects/registry.ts';
export type { EffectWorker } from './dispatcher/inProcess.ts';
export type { SettlementEvent, SettlementTransaction } from './settlements.ts';
export type { SettlementSource } from './payments/operation.ts';
export type { ChargeRequested } from './payments/request.ts';
export type { OperationStatus } from './payments/operation.ts';
export { OrderConflictError } from './payments/request.ts';
export { RefundRefused, type RefundRequested } from './payments/refund.ts';
export type { RefundReason } from './payments/gateway.ts';
export { OperationNotFoundError } from './payments/operation.ts';
export { ValidationError } from './orders/validate.ts';
export { TransactionTypeError } from './db/caller.ts';
export { ConfigError } from './config.ts';
